"""Which members of a cache group own a key: weighted rendezvous hashing (HRW), precomputed per slot.

Every key (a block, a window of a directory's small files) hashes to one of :data:`SLOTS` slots. For every slot
the members are ranked by the weighted rendezvous score ``w / -ln(u)`` (``u`` a uniform hash of the slot and the
member, ``w`` the member's cache capacity), and the best :data:`RANK` are kept in a table. A lookup is a hash and
an array index: microseconds whatever the group's size. The table is made when membership changes, not per read,
and changes incrementally: a member that joins enters the slots where it beats the last kept score, one that
leaves is replaced by the next best in the slots that ranked it. So a change moves about 1/N of the slots, and
with them about 1/N of the keys, as HRW promises.

Why slots rather than HRW per key: per key it costs one hash per member (5,000 at the target size; a
millisecond in Python), per read. Slots keep HRW's properties at the slot level. The price is granularity: a
member's share of the slots follows its weight within ~5 % at 64 members (1,024 slots each), but at 5,000
members (~13 slots each) one member's share ranges from about 0.5x to 1.6x its weight (p5-p95), while each
capacity class as a whole stays within 1 % (``python -m bench.placement_bench``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from cachefs.base.files import atomic_write

__all__ = ["RANK", "SLOTS", "Placement", "Weighted"]

#: Slots keys hash to (a power of two).
SLOTS = 1 << 16
#: Members kept per slot, best first: the owner, then the candidates asked next (hedging, hot-key replicas).
RANK = 4
_CHUNK = 2048  # slots scored at once when the table is made (memory: chunk × members × 8 bytes)


@dataclass(frozen=True)
class Weighted:
    """A member as placement sees it: a stable name and a weight (its cache capacity)."""

    name: str
    weight: float = 1.0


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uniform 64-bit hashes from structured inputs (numpy, wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _seed(name: str) -> np.uint64:
    return np.uint64(xxhash.xxh3_64_intdigest(name.encode()))


_SLOT_HASH = _mix(np.arange(SLOTS, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


def _scores(slot_hash: np.ndarray, seeds: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted rendezvous scores, slots × members."""
    with np.errstate(over="ignore"):
        h = _mix(slot_hash[:, None] ^ seeds[None, :])
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))  # in (0, 1)
    return weights[None, :] / -np.log(u)


class Placement:
    """The slot table of one group. Immutable once made: membership changes make a new one (:meth:`joined`,
    :meth:`left`), readers keep using the old one until it is swapped in."""

    def __init__(self, members: Sequence[Weighted], *, _table=None) -> None:
        self.members = list(members)
        self.names = [m.name for m in self.members]
        self._index = {n: i for i, n in enumerate(self.names)}
        if len(self._index) != len(self.names):
            raise ValueError("member names must be unique")
        self._seeds = np.array([_seed(n) for n in self.names], dtype=np.uint64)
        self._weights = np.array([max(m.weight, 1e-9) for m in self.members], dtype=np.float64)
        if _table is not None:
            self._who, self._score = _table
        else:
            self._who, self._score = self._build()

    def _build(self) -> tuple[np.ndarray, np.ndarray]:
        n, rank = len(self.names), min(RANK, len(self.names))
        who = np.full((SLOTS, RANK), -1, dtype=np.int32)
        score = np.full((SLOTS, RANK), -np.inf, dtype=np.float64)
        if n == 0:
            return who, score
        for lo in range(0, SLOTS, _CHUNK):
            s = _scores(_SLOT_HASH[lo:lo + _CHUNK], self._seeds, self._weights)
            top = np.argpartition(-s, rank - 1, axis=1)[:, :rank] if rank < n else np.tile(np.arange(n), (len(s), 1))
            top_s = np.take_along_axis(s, top, axis=1)
            order = np.argsort(-top_s, axis=1)
            who[lo:lo + _CHUNK, :rank] = np.take_along_axis(top, order, axis=1)
            score[lo:lo + _CHUNK, :rank] = np.take_along_axis(top_s, order, axis=1)
        return who, score

    # -- lookups --------------------------------------------------------------------------------------------
    @staticmethod
    def slot(key: bytes) -> int:
        return xxhash.xxh3_64_intdigest(key) & (SLOTS - 1)

    def owners(self, key: bytes, n: int = RANK) -> list[str]:
        """The best ``n`` (at most RANK) members for ``key``, owner first."""
        row = self._who[self.slot(key)]
        names = self.names
        return [names[i] for i in row[:n] if i >= 0]

    def owner(self, key: bytes) -> str | None:
        i = self._who[self.slot(key), 0]
        return self.names[i] if i >= 0 else None

    def owned_share(self, name: str) -> float:
        """The share of slots ``name`` owns."""
        i = self._index.get(name)
        return 0.0 if i is None else float(np.count_nonzero(self._who[:, 0] == i)) / SLOTS

    def slot_owners(self) -> np.ndarray:
        """The owner of every slot, as member names' indices (for tests and status)."""
        return self._who[:, 0].copy()

    # -- handing the table to another process --------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write the table (atomically) for the node's other processes: a reader in a group of thousands of
        members then loads it instead of building it (10 s at 5,000 members)."""
        atomic_write(path, lambda f: np.savez(f, names=np.array(self.names, dtype=str), weights=self._weights,
                                              who=self._who, score=self._score), dir_mode=0o700)

    @classmethod
    def load(cls, path: str, members: Sequence[Weighted]) -> Placement | None:
        """The table at ``path`` if it was made for exactly ``members`` (names and weights), else None."""
        try:
            with np.load(path, allow_pickle=False) as z:
                names = [str(n) for n in z["names"]]
                weights, who, score = z["weights"], z["who"], z["score"]
        except (OSError, ValueError, KeyError):
            return None
        want = {m.name: max(m.weight, 1e-9) for m in members}
        if len(names) != len(want) or any(want.get(n) != float(w) for n, w in zip(names, weights, strict=True)):
            return None
        if who.shape != (SLOTS, RANK) or score.shape != (SLOTS, RANK) or who.max(initial=-1) >= len(names):
            return None
        by_name = {m.name: m for m in members}
        return cls([by_name[n] for n in names], _table=(who.astype(np.int32), score.astype(np.float64)))

    # -- changes --------------------------------------------------------------------------------------------
    def joined(self, member: Weighted) -> Placement:
        """The table with ``member`` added: it takes the slots where it scores among the best RANK."""
        if member.name in self._index:
            return self.left(member.name).joined(member) if self.members[self._index[member.name]] != member else self
        members = [*self.members, member]
        i = len(self.members)
        s = _scores(_SLOT_HASH, np.array([_seed(member.name)], dtype=np.uint64),
                    np.array([max(member.weight, 1e-9)]))[:, 0]
        who, score = self._who.copy(), self._score.copy()
        rows = np.nonzero(s > score[:, -1])[0]  # the slots it enters: ~RANK/N of them, all of them while N < RANK
        both_s = np.concatenate([score[rows], s[rows, None]], axis=1)
        both_w = np.concatenate([who[rows], np.full((len(rows), 1), i, dtype=who.dtype)], axis=1)
        order = np.argsort(-both_s, axis=1, kind="stable")[:, :RANK]
        score[rows] = np.take_along_axis(both_s, order, axis=1)
        who[rows] = np.take_along_axis(both_w, order, axis=1)
        return Placement(members, _table=(who, score))

    def left(self, name: str) -> Placement:
        """The table without ``name``: the slots that ranked it take the next best member."""
        i = self._index.get(name)
        if i is None:
            return self
        members = [m for m in self.members if m.name != name]
        keep = np.array([j for j in range(len(self.members)) if j != i], dtype=np.int64)
        remap = np.full(len(self.members) + 1, -1, dtype=np.int32)  # old index → new index (-1 stays -1)
        remap[keep] = np.arange(len(keep), dtype=np.int32)
        who, score = self._who.copy(), self._score.copy()
        rows = np.nonzero((who == i).any(axis=1))[0]
        who = np.where(who >= 0, remap[np.where(who >= 0, who, len(self.members))], -1).astype(np.int32)
        new = Placement.__new__(Placement)
        new.members, new.names = members, [m.name for m in members]
        new._index = {n: k for k, n in enumerate(new.names)}
        new._seeds, new._weights = self._seeds[keep], self._weights[keep]
        if len(rows):  # rescore those slots over the remaining members
            rank = min(RANK, len(members))
            s = _scores(_SLOT_HASH[rows], new._seeds, new._weights) if len(members) else np.empty((len(rows), 0))
            for k, r in enumerate(rows):
                if rank == 0:
                    who[r], score[r] = -1, -np.inf
                    continue
                top = np.argsort(-s[k])[:rank]
                who[r] = -1
                score[r] = -np.inf
                who[r, :rank], score[r, :rank] = top, s[k][top]
        new._who, new._score = who, score
        return new

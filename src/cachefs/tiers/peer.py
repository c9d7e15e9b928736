"""The cache group as a tier: missing bytes come from the member that owns them.

A block's owners are its rendezvous-hash candidates in the group (:mod:`cachefs.cluster.placement`): the owner
first, then the next ones. The owner's peer server answers from its disk or, for a key it owns, fetches it from
the origin once for the whole group (its single-flight), so N nodes reading one cold block cause one GET. This
node asks its own peer server too when it is the owner: every origin fetch of a group key happens in one place.

A slow, dead or wrong peer is not the reader's problem:

* **hedging**: a candidate that has not answered within ``hedge_after`` seconds gets company, the next
  candidate is asked as well, and the first right answer wins;
* **circuit breaker**: a peer that failed ``BREAKER_FAILURES`` times in a row is skipped for a while (5 s,
  doubling to 60 s while it keeps failing);
* then the tier gives up and the chain moves on (mirror, origin), counted as a fallback with its reason.

Draining members (gone from the API, within their grace period) are asked last.

**Hot directories.** A member that serves a directory faster than one node should (:mod:`cachefs.cluster.heat`)
says so in its answers: the directory's keys get ``r`` more holders, the next rendezvous candidates. Readers
then spread over the ``r + 1`` holders by the power of two choices (two holders at random, the one with fewer of
this process's requests in flight), and a holder that is not the owner is asked as a *replica*: its agent fetches
the key from the owner (the owner alone fetches from the origin) and keeps it. Directories known in advance to
be hot are declared (``cluster.replicas``). A reader forgets a directory is hot when its owner answers without
saying so, or :data:`HOT_TTL` seconds after the owner last said it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Callable

from cachefs.base.config import parse_replicas
from cachefs.base.errors import CacheFSError
from cachefs.cluster.keys import ASKED_AS_REPLICA, ASKED_BY, OWNERS_THAT_FETCH, DirectoryWindows, block_key
from cachefs.cluster.link import GroupView
from cachefs.tiers.base import Keep, Kind, Served, Tier, TierParts, Want

__all__ = ["BREAKER_FAILURES", "COLD_AFTER", "COLD_FOR", "HOLDER_ASKS", "HOT_TTL", "Breaker", "PeerTier"]

log = logging.getLogger(__name__)

BREAKER_FAILURES = 3
#: Seconds a reader keeps spreading a hot directory after its owner last said it is hot.
HOT_TTL = 10.0
#: Members an owner asks whether they hold a key before it fetches the key from the origin.
HOLDER_ASKS = 8
#: A dataset whose holders' answers missed this many times in a row is cold for COLD_FOR seconds.
COLD_AFTER = 16
COLD_FOR = 30.0


class Breaker:
    """Per peer: consecutive failures, and until when it is skipped."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._failures: dict[str, int] = {}
        self._open_until: dict[str, float] = {}

    def closed(self, name: str) -> bool:
        return self._open_until.get(name, 0.0) <= self.clock()

    def success(self, name: str) -> None:
        self._failures.pop(name, None)
        self._open_until.pop(name, None)

    def failure(self, name: str) -> None:
        n = self._failures[name] = self._failures.get(name, 0) + 1
        if n >= BREAKER_FAILURES:
            self._open_until[name] = self.clock() + min(60.0, 5.0 * 2 ** (n - BREAKER_FAILURES))


class PeerTier(Tier):
    """``group`` is the cache group as the read path sees it (:class:`~cachefs.cluster.link.GroupView`): its
    ``table`` and ``client`` are None while this node is in no group, and then the tier has nothing (and the numpy
    and aiohttp behind them are not loaded). ``group.serving`` is True in the agent: it asks peers only as a
    replica of a hot key (:data:`~cachefs.cluster.keys.ASKED_AS_REPLICA`). ``declared`` are the
    ``cluster.replicas`` prefixes with their replica counts, longest first. What peers send is kept as guest data
    with ``keep_guest`` (and always in the agent), else not at all (its owner keeps it)."""

    name = "peer"

    def __init__(self, group: GroupView, *, kind: Kind, block_size: int = 0, hedge_after: float = 0.25,
                 candidates: int = 2, keep_guest: bool = True, declared: list[tuple[str, int]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if kind not in ("block", "small") or (kind == "block" and block_size <= 0):
            raise ValueError(f"a peer tier of {kind!r} (block size {block_size})")
        self.group, self.kind, self.block_size, self.keep_guest = group, kind, block_size, keep_guest
        self.hedge_after, self.candidates = hedge_after, candidates
        self.declared = declared or []
        self.clock = clock
        self.breaker = Breaker(clock)
        self.windows = DirectoryWindows()
        #: Hot directories, (dataset id, directory) → (replicas, until when), as their holders said.
        self.hot: dict[tuple[str, str], tuple[int, float]] = {}
        #: This process's requests in flight per member (the power of two choices picks the less busy).
        self.in_flight: dict[str, int] = {}
        #: Requests that hedging sent to a second candidate; requests sent to a replica rather than the owner.
        self.hedged = 0
        self.spread = 0
        #: Keys this agent took from members holding a copy instead of the origin.
        self.from_holders = 0
        #: Per dataset: holders' asks that missed in a row, and until when it is cold (see _from_holders).
        self._cold: dict[str, tuple[int, float]] = {}

    @classmethod
    def build(cls, parts: TierParts, kind: Kind) -> PeerTier:
        c = parts.config
        return cls(parts.group, kind=kind, block_size=c.cache.block_size, hedge_after=c.cluster.hedge_after,
                   keep_guest=c.cluster.keep_guest, declared=parse_replicas(c.cluster.replicas))

    def _served(self, data: bytes | None) -> Served | None:
        if data is None:
            return None
        return Served(data, self.name, Keep.GUEST if self.keep_guest or self.group.serving else Keep.NONE)

    def replicas(self, want: Want) -> int:
        """Extra holders of ``want``'s directory: declared (``cluster.replicas``) or announced by its holders."""
        ds, path = want.ds, want.entry.path
        directory = path.rpartition("/")[0]
        r = 0
        if self.declared:
            url = f"{ds.ref.url}/{path}"
            r = next((n for prefix, n in self.declared if url == prefix or url.startswith(prefix + "/")), 0)
        said = self.hot.get((ds.ref.id, directory))
        if said is not None:
            if said[1] > self.clock():
                r = max(r, said[0])
            else:
                del self.hot[ds.ref.id, directory]
        return r

    def _order(self, key: bytes, holders: int) -> list[str]:
        """The key's candidates to ask, best first: the first ``holders`` by the power of two choices, then the
        rest in rank order; draining members last."""
        table = self.group.table
        if table is None:
            return []
        names = [n for n in table.placement.owners(key) if self.breaker.closed(n)]
        names = [n for n in names if table.active(n)] + [n for n in names if not table.active(n)]
        if holders > 1 and len(names) > 1:
            pool = names[:holders]
            a, b = random.sample(pool, 2) if len(pool) > 1 else (pool[0], pool[0])
            pick = a if self.in_flight.get(a, 0) <= self.in_flight.get(b, 0) else b
            names.remove(pick)
            names.insert(0, pick)
        return names

    async def fetch(self, want: Want) -> Served | None:
        table = self.group.table
        if table is None:
            return None
        if self.kind == "block":
            if want.start % self.block_size:
                return None  # (the block path asks for whole blocks)
            key = block_key(want.okey, want.start // self.block_size)
        else:
            if not want.whole:
                return None
            key = self.windows.key(want.ds, want.entry.path)
        if self.group.serving:
            if ASKED_AS_REPLICA.get():
                return self._served(await self._as_replica(key, want))
            got = await self._from_holders(key, want)
            return Served(got, self.name, Keep.OWN) if got is not None else None  # (the owner keeps its own)
        order = self._order(key, 1 + self.replicas(want))[: self.candidates]
        if not order:
            return None
        return self._served(await self._hedged(order, want, owner=table.placement.owner(key)))

    async def _from_holders(self, key: bytes, want: Want) -> bytes | None:
        """In the agent, about to fetch a key of its own from the origin: first from members that may hold a copy
        (after a member left or joined, the keys that moved are mostly still in the group: the old owner's
        replicas, the readers' guest copies). Up to :data:`HOLDER_ASKS` members (the one asking aside) are asked
        at once whether they hold it, never to fetch it; the first to answer within ``hedge_after`` wins. A dataset
        whose last :data:`COLD_AFTER` asks all missed is cold: its keys go to the origin at once for
        :data:`COLD_FOR` seconds (a first epoch costs the group no more than a few asks), except keys this node
        fetches in place of their owner (the owner is down: what it held is likely elsewhere too)."""
        table = self.group.table
        if table is None:
            return None
        ds_id = want.ds.ref.id
        cold = self._cold.get(ds_id)
        ranked = table.placement.owners(key)
        in_place_of_owner = bool(ranked) and ranked[0] != table.self_name
        if cold is not None and cold[1] > self.clock() and not in_place_of_owner:
            return None
        asker = ASKED_BY.get()
        names = [n for n in table.members if n not in (table.self_name, asker) and table.active(n)
                 and self.breaker.closed(n)]
        names.sort(key=lambda n: hashlib.blake2b(key + n.encode(), digest_size=8).digest())  # spread, stable per key
        tasks = [asyncio.ensure_future(self._ask(n, want, False, None)) for n in names[:HOLDER_ASKS]]
        got = None
        try:
            pending = set(tasks)
            deadline = self.clock() + self.hedge_after
            while pending and got is None:
                done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - self.clock()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break  # the holders are slow: the origin then
                for t in done:
                    if not t.cancelled() and t.exception() is None and t.result() is not None:
                        got = t.result()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        misses = 0 if got is not None else (cold[0] if cold is not None else 0) + 1
        if misses >= COLD_AFTER:
            self._cold[ds_id] = (0, self.clock() + COLD_FOR)
        else:
            self._cold[ds_id] = (misses, 0.0)
        if got is not None:
            self.from_holders += 1
        return got

    async def _as_replica(self, key: bytes, want: Want) -> bytes | None:
        """In the agent, asked as a replica: the key from the members ranked before this one among those that
        fetch from the origin (the owner first)."""
        table = self.group.table
        if table is None:
            return None
        ranked = table.placement.owners(key)
        if table.self_name not in ranked:
            return None
        before = ranked[: min(ranked.index(table.self_name), OWNERS_THAT_FETCH)]
        order = [n for n in before if self.breaker.closed(n) and table.active(n)]
        try:
            got = await self._hedged(order, want, owner=ranked[0]) if order else None
        except CacheFSError as exc:  # the owner is down: its copies may still be elsewhere in the group
            log.info("asked as a replica, the owner failed (%s); asking the members that may hold a copy", exc)
            got = None
        return got if got is not None else await self._from_holders(key, want)

    async def _ask(self, name: str, want: Want, fetch: bool, owner: str | None, *, replica: bool = False
                   ) -> bytes | None:
        table, client = self.group.table, self.group.client
        member = table.member(name) if table is not None else None
        if member is None or client is None:
            return None
        ds, e = want.ds, want.entry
        replica = replica and name != owner and not self.group.serving
        self.spread += replica
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        try:
            if self.kind == "block":
                got, hot = await client.block(member.address, ds.ref.id, ds.ref.url, e.path, e.version,
                                              want.start // self.block_size, want.length, fetch=fetch,
                                              replica=replica)
            else:
                got, hot = await client.small(member.address, ds.ref.id, ds.ref.url, e.path, e.version,
                                              want.length, fetch=fetch, replica=replica)
        except CacheFSError:  # (the client's PeerError)
            self.breaker.failure(name)
            raise
        finally:
            self.in_flight[name] -= 1
        self.breaker.success(name)
        where = (ds.ref.id, e.path.rpartition("/")[0])
        if hot:
            self.hot[where] = (hot, self.clock() + HOT_TTL)
        elif name == owner:  # the owner no longer counts it hot
            self.hot.pop(where, None)
        return got

    async def _hedged(self, order: list[str], want: Want, *, owner: str | None) -> bytes | None:
        """Ask ``order[0]``; if it is slow, ask the next one too, but only for bytes it already holds (a hedge
        must not cost a second origin fetch); if one fails, the next one is asked and may fetch."""
        tasks: dict[asyncio.Task, str] = {}
        errors: list[str] = []
        pending_names = list(order)

        def start_next(fetch: bool) -> None:
            # Only the first ask can be a replica's (a hot directory spread over its holders); the next ones stand
            # in for a slow or failed candidate: asked as such, they take copies from holders before the origin.
            first = len(pending_names) == len(order)
            name = pending_names.pop(0)
            tasks[asyncio.ensure_future(self._ask(name, want, fetch, owner, replica=first))] = name

        start_next(True)
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, timeout=self.hedge_after if pending_names else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:  # the candidates asked are slow: ask the next one too
                    self.hedged += 1
                    start_next(False)
                    continue
                failed = False
                for t in done:
                    tasks.pop(t)
                    try:
                        got = t.result()
                    except CacheFSError as exc:
                        errors.append(str(exc))
                        failed, got = True, None
                    if got is not None:
                        return got
                if pending_names and (failed or not tasks):
                    start_next(failed)
        finally:
            for t in tasks:
                t.cancel()
        if errors:
            raise CacheFSError("; ".join(errors))
        return None

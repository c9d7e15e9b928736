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
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import OrderedDict

from ..dataset import Dataset
from ..errors import CacheFSError
from .base import Tier, Want

__all__ = ["BREAKER_FAILURES", "SMALL_WINDOW", "Breaker", "DirectoryWindows", "PeerTier", "block_key", "small_key"]

log = logging.getLogger(__name__)

BREAKER_FAILURES = 3


def block_key(okey: bytes, idx: int) -> bytes:
    """The placement key of block ``idx`` of an object version (``okey`` names dataset, object and version)."""
    return b"b" + okey + idx.to_bytes(4, "big")


#: Small files are placed by windows of this many names of their directory (sorted): neighbours, read ahead and
#: packed together, share an owner, and a directory of a million files still spreads over the group.
SMALL_WINDOW = 256


def small_key(ds_id: str, path: str, window: int) -> bytes:
    """The placement key of a small file: window ``window`` of its directory."""
    return (b"d" + ds_id.encode() + b"/" + path.rpartition("/")[0].encode("utf-8", "surrogateescape") + b"#"
            + window.to_bytes(4, "big"))


class DirectoryWindows:
    """The placement key of a small file (:func:`small_key`), from its position in its directory's sorted listing
    in the reader's manifest version (sorted names kept for the last ``keep`` directories)."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._names: OrderedDict[tuple[str, int, str], list[str]] = OrderedDict()

    def key(self, ds: Dataset, path: str) -> bytes:
        parent, _, name = path.rpartition("/")
        at = (ds.ref.id, ds.version, parent)
        names = self._names.get(at)
        if names is None:
            names = self._names[at] = sorted(e.path.rpartition("/")[2] for e in ds.listdir(parent))
            if len(self._names) > self.keep:
                self._names.popitem(last=False)
        else:
            self._names.move_to_end(at)
        return small_key(ds.ref.id, path, bisect.bisect_left(names, name) // SMALL_WINDOW)


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
    """``group`` has ``table`` (a cluster.MemberTable) and ``client`` (a cluster.PeerClient), both None while
    this node is in no group: then the tier has nothing (and the numpy and aiohttp behind them are not loaded)."""

    name = "peer"

    def __init__(self, group, *, kind: str, block_size: int = 0, hedge_after: float = 0.25,
                 candidates: int = 2, kept: bool = True) -> None:
        if kind not in ("block", "small") or (kind == "block" and block_size <= 0):
            raise ValueError(f"a peer tier of {kind!r} (block size {block_size})")
        self.group, self.kind, self.block_size, self.kept = group, kind, block_size, kept
        self.hedge_after, self.candidates = hedge_after, candidates
        self.breaker = Breaker()
        self.windows = DirectoryWindows()
        #: Requests that hedging sent to a second candidate.
        self.hedged = 0

    def _order(self, key: bytes) -> list[str]:
        table = self.group.table
        names = [n for n in table.placement.owners(key) if self.breaker.closed(n)]
        return [n for n in names if table.active(n)] + [n for n in names if not table.active(n)]

    async def fetch(self, want: Want) -> bytes | None:
        if self.group.table is None:
            return None
        if self.kind == "block":
            if want.start % self.block_size:
                return None  # (the block path asks for whole blocks)
            key = block_key(want.okey, want.start // self.block_size)
        else:
            if not want.whole:
                return None
            key = self.windows.key(want.ds, want.entry.path)
        order = self._order(key)[: self.candidates]
        if not order:
            return None
        return await self._hedged(order, want)

    async def _ask(self, name: str, want: Want, fetch: bool) -> bytes | None:
        member = self.group.table.member(name)
        client = self.group.client
        if member is None or client is None:
            return None
        ds, e = want.ds, want.entry
        try:
            if self.kind == "block":
                got = await client.block(member.address, ds.ref.id, ds.ref.url, e.path, e.version,
                                              want.start // self.block_size, want.length, fetch=fetch)
            else:
                got = await client.small(member.address, ds.ref.id, ds.ref.url, e.path, e.version, want.length,
                                              fetch=fetch)
        except CacheFSError:  # (the client's PeerError)
            self.breaker.failure(name)
            raise
        self.breaker.success(name)
        return got

    async def _hedged(self, order: list[str], want: Want) -> bytes | None:
        """Ask ``order[0]``; if it is slow, ask the next one too, but only for bytes it already holds (a hedge
        must not cost a second origin fetch); if one fails, the next one is asked and may fetch."""
        tasks: dict[asyncio.Task, str] = {}
        errors: list[str] = []
        pending_names = list(order)

        def start_next(fetch: bool) -> None:
            name = pending_names.pop(0)
            tasks[asyncio.ensure_future(self._ask(name, want, fetch))] = name

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

"""Small objects: fetched whole (one GET, or a mirror window), kept in pack files, read back with one ``pread``.

Objects of at most ``cache.pack_threshold`` bytes take this path. A fetched object is served to its reader at
once and joins its dataset's pending pack in memory (:mod:`.pending_packs`); only once that pack is written does
the index point the members at it, so other processes find every member either nowhere (they fetch it too: same
version, same bytes) or in a complete pack. A window of a packed mirror that a tier brought is installed here as
it is (:mod:`cachefs.node.pack_assembly`), and the rest of its pack and the next one are read ahead. Local reads,
from any thread, are :mod:`.pack_reads`'s.

Directory read-ahead: after a miss on a small file, the next ``engine.dir_readahead`` small files of its
directory (in listing order, :mod:`cachefs.prefetch.directories`) are handed to the prefetcher, which fetches
them with spare memory only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from cachefs.base.checksum import block_checksum
from cachefs.base.config import Config
from cachefs.base.errors import CacheFullError
from cachefs.base.types import Entry, object_key
from cachefs.formats.mirror_index import MirrorWindow
from cachefs.formats.pack_file import WOULD_WAIT, Member, MemberRead
from cachefs.index import Index
from cachefs.manifest.dataset import Dataset
from cachefs.node.admission import Admission
from cachefs.node.budget import Reservation
from cachefs.node.bytes_lru import BytesLRU
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.flight import SingleFlight
from cachefs.node.funnel import OriginFunnel
from cachefs.node.pack_assembly import PackAssemblies
from cachefs.node.read_stats import ReadStats
from cachefs.prefetch.directories import DirectoryAhead
from cachefs.prefetch.prefetcher import Hint, Prefetcher
from cachefs.read.base import OpenFile, ReadStrategy, ReadStream
from cachefs.read.pack_reads import PackReads
from cachefs.read.pending_packs import PendingPacks
from cachefs.store.base import PackStore
from cachefs.tiers import BatchRef, Keep, TierChain, Want

__all__ = ["PackStrategy", "PackedFile"]

#: Files fetched last that are remembered (not read ahead again).
_MAX_FETCHED = 1 << 16

log = logging.getLogger(__name__)


class PackStrategy(ReadStrategy):
    packed = True

    def __init__(self, config: Config, store: PackStore, index: Index, chain: TierChain, funnel: OriginFunnel,
                 admission: Admission, disk: DiskJobs, stats: ReadStats, assemblies: PackAssemblies,
                 prefetcher: Prefetcher) -> None:
        c = config.cache
        self.threshold, self.pack_size = c.pack_threshold, c.pack_size
        self.store, self.index, self.chain, self.funnel, self.disk, self.stats = store, index, chain, funnel, disk, stats
        self.assemblies, self.prefetcher, self.admission = assemblies, prefetcher, admission
        self.pending = PendingPacks(c.pack_size, store, index, admission, stats, disk, on_dropped=self._dropped)
        self.directories = DirectoryAhead(config.engine.dir_readahead)
        # Small files the group's peers sent and this node does not store (cluster.keep_guest off): kept in
        # memory for a while, as a directory's read-ahead brings them before their readers ask.
        self.guests = BytesLRU(config.engine.memory_budget // 8)
        # Read ahead and not kept (the disk had no room): held for the reader still to come. Readers take them in
        # the order they were fetched, so the oldest go first, read or not.
        self.unread = BytesLRU(config.engine.memory_budget // 8, promote=False)
        self.reads = PackReads(store, index, self.pending, assemblies, stats, self.guests, self.unread)
        # The files fetched last (by readers or ahead): never read ahead again while remembered, so one the disk
        # did not keep (it was full) costs no second fetch.
        self._fetched: OrderedDict[bytes, None] = OrderedDict()
        self._fetches = SingleFlight()  # object key → bytes
        self.closing = False
        removed = self.store.clean(index.has_pack)
        if removed:
            log.info("removed %d unfinished or orphaned pack file(s)", removed)

    def packable(self, entry: Entry) -> bool:
        return entry.size <= self.threshold

    def open(self, ds: Dataset, entry: Entry, *, pin: bool = True) -> PackedFile:
        return PackedFile(self, ds, entry, ReadStream())

    def oneoff(self, ds: Dataset, entry: Entry, stream: ReadStream | None) -> PackedFile:
        return PackedFile(self, ds, entry, stream)

    # -- what is here (any thread) --------------------------------------------------------------------------
    def has(self, okey: bytes) -> bool:
        return self.reads.has(okey)

    def local(self, ds_id: str, okey: bytes, size: int, *, wait: bool = True
              ) -> bytes | bytearray | Literal[MemberRead.WOULD_WAIT] | None:
        return self.reads.local(ds_id, okey, size, wait=wait)

    def cached_bytes(self, ds: Dataset, entry: Entry, okey: bytes) -> int:
        return entry.size if entry.size == 0 or self.has(okey) else 0

    # -- fetching (event loop) ------------------------------------------------------------------------------
    async def fetch(self, ds: Dataset, okey: bytes, entry: Entry, *, reader: bool = True) -> tuple[bytes, bool]:
        """The whole object, fetched if no one has it (single-flight); (bytes, whether this call fetched).
        ``reader``: for a reader (what comes with it counts as read-ahead), not a prefetch job."""
        data = self.local(ds.ref.id, okey, entry.size)
        if data is not None and data is not WOULD_WAIT:
            return data if type(data) is bytes else bytes(data), False
        fut = self._fetches.get(okey)
        started = fut is None
        if fut is None:
            fut = self._fetches.start(okey, self._fetch(ds, okey, entry, None, reader=reader))
        return await asyncio.shield(fut), started

    async def ensure(self, ds: Dataset, entry: Entry, on_bytes: Callable[[int], None] | None = None) -> None:
        await self.fetch(ds, object_key(ds.ref.id, entry.path, entry.version), entry, reader=False)

    async def _fetch(self, ds: Dataset, okey: bytes, entry: Entry, held: Reservation | None, *,
                     reader: bool, wanted: Callable[[], bool] | None = None) -> bytes:
        async with held or await self.funnel.hold(entry.size):
            served = await self.chain.fetch(Want(ds, entry, okey, 0, entry.size, wanted))
        # A whole small object is handed to readers (and waits in its pending pack) as it is: bytes, not the
        # bytearray a source may have received the body into.
        data = served.data if type(served.data) is bytes else bytes(served.data)
        self._note_fetched(okey)
        if served.batch is not None:
            self._install(ds, served.batch, self.chain.batches_after(served), okey, reader=reader)
        if served.keep is Keep.NONE:  # the group member that owns it keeps it
            self.guests.put(okey, data)
        elif not self.has(okey):
            await self.pending.add(ds.ref.id, Member(okey, entry.path, entry.version, block_checksum(data), data),
                                   guest=served.keep is Keep.GUEST)
        await self.assemblies.backlog()
        return data

    def _install(self, ds: Dataset, window: MirrorWindow, after: list[BatchRef], asked: bytes | None, *,
                 reader: bool) -> None:
        """Keep a batch here (the members of its pack window this node lacks), and read ``after`` ahead (the rest
        of its pack, as the tier that served it says)."""
        keep = [m for m in window.members if m[0] == asked or not self.has(m[0])]
        if not self.assemblies.accept(window, keep):
            return  # (another reader of the window installed it)
        if reader:
            self.stats.note_ahead([m[0] for m in keep if m[0] != asked])
        if asked is not None and not self.closing:
            hints = [self._window_hint(ds, ref, reader) for ref in after if not self._window_here(ref)]
            hints = self._keepable(ds.ref.id, hints)
            if hints:
                self.prefetcher.offer(hints)

    def _window_here(self, ref: BatchRef) -> bool:
        if self.assemblies.accepted(ref.ds_id, ref.pack, ref.window):
            return True
        return (ref.first is not None and not self.assemblies.assembling(ref.ds_id, ref.pack)
                and self.index.packed(ref.first) is not None)

    def _window_hint(self, ds: Dataset, ref: BatchRef, reader: bool) -> Hint:
        return Hint(("window", ds.ref.id, ref.tier, ref.pack, ref.window), ref.nbytes, ref.tier,
                    functools.partial(self._window_ahead, ds, ref, reader))

    async def _window_ahead(self, ds: Dataset, ref: BatchRef, reader: bool, held: Reservation | None) -> None:
        """Read a batch ahead (the prefetcher runs this with memory ``held`` for it)."""
        if self.closing or self._window_here(ref):
            return  # (the prefetcher gives back the memory held for it)
        window = await self.chain.fetch_batch(ds, ref, held)
        if not self.assemblies.accepted(ref.ds_id, ref.pack, ref.window):
            self._install(ds, window, [], None, reader=reader)
        await self.assemblies.backlog()

    # -- directory read-ahead -------------------------------------------------------------------------------
    def read_ahead(self, ds: Dataset, entry: Entry) -> None:
        """After a miss on ``entry``: hand the prefetcher the next small files of its directory."""
        if self.closing:
            return
        hints = []
        for e in self.directories.after_miss(ds, entry):
            if e.is_dir or not self.packable(e) or e.size == 0:
                continue
            okey = object_key(ds.ref.id, e.path, e.version)
            if okey not in self._fetches and okey not in self._fetched and not self.has(okey):
                hints.append(Hint(okey, e.size, "directory", functools.partial(self._fetch_ahead, ds, okey, e)))
        hints = self._keepable(ds.ref.id, hints)
        if hints:
            self.prefetcher.offer(hints)

    def _note_fetched(self, okey: bytes) -> None:
        self._fetched[okey] = None
        while len(self._fetched) > _MAX_FETCHED:
            self._fetched.popitem(last=False)

    def _dropped(self, members: list[Member]) -> None:
        """Pending members the disk had no room for (a disk thread): those read ahead for a reader still to come
        stay in memory for it."""
        for m in members:
            if self.stats.unread_ahead(m.okey):
                self.unread.put(m.okey, m.data)

    def _keepable(self, ds_id: str, hints: list[Hint]) -> list[Hint]:
        """The first of ``hints`` the disk can keep without evicting anything: read-ahead never fetches what the
        cache would have to drop again before its reader comes (a dataset twice the cache, read ahead by
        directory in a shuffled epoch, cost ten times the dataset from the origin). Room under the high watermark
        (all a scanned dataset is admitted into), less what is already on its way to the disk."""
        if not hints:
            return hints
        space = self.admission.space
        if space.full or self.admission.scan_refusing(ds_id):
            return []
        room = space.room_under_high() - self.pending.unwritten - self.prefetcher.outstanding_bytes
        out, need = [], 0
        for h in hints:
            need += h.nbytes
            if need > room:
                break
            out.append(h)
        return out

    def _room_for(self, nbytes: int) -> bool:
        space = self.admission.space
        return not space.full and space.room_under_high() - self.pending.unwritten >= nbytes

    def ahead_hints(self, ds: Dataset, entry: Entry) -> list[Hint]:
        okey = object_key(ds.ref.id, entry.path, entry.version)
        if entry.size == 0 or okey in self._fetches or self.has(okey):
            return []
        return [Hint(okey, entry.size, "order", functools.partial(self._fetch_ahead, ds, okey, entry, ordered=True))]

    async def _fetch_ahead(self, ds: Dataset, okey: bytes, entry: Entry, held: Reservation | None, *,
                           ordered: bool = False) -> None:
        """Fetch a small file ahead of its reader (the prefetcher runs this with memory ``held`` for it): by now
        it may have come with a mirror window or a pack, or a reader may be fetching it. ``ordered``: its
        reader comes next (a declared order), so it is fetched even if it was fetched lately and not kept."""
        if self.closing or okey in self._fetches or (okey in self._fetched and not ordered) or self.has(okey):
            return
        # Its GET may start a while later (readers first): by then the disk may have no room left to keep it, and
        # read-ahead never fetches what the cache would drop before its reader comes (see _keepable).
        wanted = None if ordered else functools.partial(self._room_for, entry.size)
        self.stats.note_ahead((okey,))  # before its bytes are visible: a reader then counts a miss, not a hit
        await asyncio.shield(self._fetches.start(okey, self._fetch(ds, okey, entry, held, reader=True, wanted=wanted)))

    # -- serving peers ----------------------------------------------------------------------------------------
    async def serve(self, ds: Dataset, entry: Entry, block: int | None, *, fetch: bool) -> tuple[bytes, int] | None:
        """The whole small file for a peer, verified, with its checksum: from this node, or with ``fetch`` (this
        node owns its directory) fetched first; None otherwise."""
        if block is not None:
            return None
        okey = object_key(ds.ref.id, entry.path, entry.version)
        got = await asyncio.to_thread(self.local, ds.ref.id, okey, entry.size)
        data = bytes(got) if got is not None and got is not WOULD_WAIT else None
        if data is None and fetch:
            data, _ = await self.fetch(ds, okey, entry)
        if data is None:
            return None
        return data, block_checksum(data)

    def refused(self) -> CacheFullError | None:
        """Why the last small files fetched could not all be kept (the disk was full), from whichever of the two
        pack writers (pending packs, mirror windows) met it; None once they kept the next."""
        return self.pending.full_error or self.assemblies.full_error

    def stop(self) -> list[asyncio.Future]:
        """Stop starting work; the fetches in flight (for the caller to cancel and await)."""
        self.closing = True
        return [*self._fetches.runs(), *self.chain.stop()]

    # -- counting -------------------------------------------------------------------------------------------
    def count(self, ds: Dataset, entry: Entry, stream: ReadStream | None, hit: int = 0, miss: int = 0) -> None:
        access = stream is None or not stream.counted
        if stream is not None:
            stream.counted = True
        self.stats.count(ds.ref.id, entry.path if access else None, hit, miss, "small")


class PackedFile(OpenFile):
    """A small file: read whole and verified, later pieces sliced from the whole. With ``stream`` None (a
    one-off read) every read is an access of its own and starts no read-ahead."""

    packed = True

    def __init__(self, strategy: PackStrategy, ds: Dataset, entry: Entry, stream: ReadStream | None) -> None:
        self.strategy, self.ds, self.entry, self.stream = strategy, ds, entry, stream
        self.okey = object_key(ds.ref.id, entry.path, entry.version)

    def read_local(self, start: int, end: int, *, wait: bool = True
                   ) -> bytes | bytearray | Literal[MemberRead.WOULD_WAIT] | None:
        end = min(end, self.entry.size)
        if start >= end:
            return b""
        stream, strategy = self.stream, self.strategy
        member = stream.member if stream is not None else None
        if stream is not None and member is not None and member[0] == self.okey:
            whole = member[1]
            if end == len(whole):
                stream.member = None  # the last piece: do not hold the bytes as long as the stream lives
        else:
            got = strategy.local(self.ds.ref.id, self.okey, self.entry.size, wait=wait)
            if got is None or got is WOULD_WAIT:
                return got
            whole = got
            self._keep_member(whole, start, end)
        ahead = strategy.stats.take_ahead(self.okey)
        strategy.count(self.ds, self.entry, stream, hit=0 if ahead else end - start, miss=end - start if ahead else 0)
        return whole[start:end] if (start, end) != (0, len(whole)) else whole

    async def read(self, start: int, end: int) -> bytes:
        end = min(end, self.entry.size)
        if start >= end:
            return b""
        strategy = self.strategy
        whole, fetched = await strategy.fetch(self.ds, self.okey, self.entry)
        self._keep_member(whole, start, end)
        miss = strategy.stats.take_ahead(self.okey) or fetched
        strategy.count(self.ds, self.entry, self.stream, hit=0 if miss else end - start,
                       miss=end - start if miss else 0)
        if fetched and self.stream is not None:
            strategy.read_ahead(self.ds, self.entry)
        return whole[start:end]

    def _keep_member(self, whole: bytes | bytearray, start: int, end: int) -> None:
        """Keep the bytes on the stream when this read took only part of them (more pieces follow)."""
        if self.stream is not None and end - start < len(whole):
            self.stream.member = (self.okey, whole)

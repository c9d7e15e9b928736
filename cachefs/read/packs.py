"""Small objects: fetched whole (one GET, or a mirror window), kept in pack files, read back with one ``pread``.

Objects of at most ``cache.pack_threshold`` bytes take this path. A fetched object is served to its reader at
once and joins its dataset's pending pack in memory (:mod:`.pack_writer`); only once that pack is written does
the index point the members at it, so other processes find every member either nowhere (they fetch it too: same
version, same bytes) or in a complete pack. Files a mirror window brought are
installed by the mirror tier (:mod:`cachefs.node.pack_assembly`) and read from there.

Reads verify the member's xxh3 every time (a member is at most ``pack_threshold`` bytes, so that is cheaper
than remembering what was verified); a mismatch drops the member from the index and it is fetched again.

Pack read-ahead: a member is read with exactly one ``pread`` (the device's read-ahead is off for packs), but a
pack that several reads hit within a few seconds is being swept (:func:`~cachefs.prefetch.planners.sweep`) and is read
into the page cache whole, so its other members cost no disk request each.

Directory read-ahead: after a miss on a small file, the next ``engine.dir_readahead`` small files of its
directory (in listing order, :func:`~cachefs.prefetch.planners.directory_ahead`) are fetched in the background with spare
memory only.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import threading
import time
from collections import OrderedDict

from cachefs.base.checksum import block_checksum
from cachefs.base.config import Config
from cachefs.base.types import Entry, object_key
from cachefs.index import Index
from cachefs.index.records import pack_key
from cachefs.manifest.dataset import Dataset
from cachefs.node.budget import Reservation
from cachefs.node.bytes_lru import BytesLRU
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.eviction import Evictor
from cachefs.node.flight import SingleFlight
from cachefs.node.funnel import OriginFunnel
from cachefs.node.pack_assembly import PackAssemblies
from cachefs.node.read_stats import ReadStats
from cachefs.prefetch.planners import directory_ahead, sweep
from cachefs.read.pack_writer import PendingPacks
from cachefs.read.stream import OpenFile, ReadStream
from cachefs.store.packs import CORRUPT, WOULD_WAIT, Member, PackStore, read_member
from cachefs.tiers import TierChain, Want

__all__ = ["PackPath", "PackedFile"]

log = logging.getLogger(__name__)

_MAX_OPEN_PACKS = 256
#: A pack read this many times within SWEEP_WINDOW seconds is read ahead whole (see the module docstring).
SWEEP_READS = 3
SWEEP_WINDOW = 5.0
_READ_AHEAD_PIECE = 2 * 1024 * 1024
_MAX_LISTINGS = 64

def _read_ahead(fd: int) -> None:
    """Read the whole file into the page cache, from a thread of its own (the kernel submits the reads before
    WILLNEED returns, and they can wait for the device's queue); closes ``fd``. One WILLNEED reads at most the
    device's read-ahead maximum, so the file is asked for in pieces."""
    def run() -> None:
        try:
            size = os.fstat(fd).st_size
            for start in range(0, size, _READ_AHEAD_PIECE):
                os.posix_fadvise(fd, start, _READ_AHEAD_PIECE, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    threading.Thread(target=run, name="cachefs-pack-readahead", daemon=True).start()


class PackPath:
    def __init__(self, config: Config, store: PackStore, index: Index, chain: TierChain, funnel: OriginFunnel,
                 evictor: Evictor, disk: DiskJobs, stats: ReadStats, assemblies: PackAssemblies) -> None:
        c = config.cache
        self.threshold, self.pack_size = c.pack_threshold, c.pack_size
        self.readahead = config.engine.dir_readahead
        self.store, self.index, self.chain, self.funnel, self.disk, self.stats = store, index, chain, funnel, disk, stats
        self.assemblies = assemblies
        self._lock = threading.Lock()  # open packs are used from FUSE threads too
        self.pending = PendingPacks(c.pack_size, store, index, evictor, disk)
        self._fds: OrderedDict[bytes, int] = OrderedDict()  # pack key → descriptor
        self._fetches = SingleFlight()  # object key → bytes
        self._listings: OrderedDict[tuple[str, int, str], tuple[list[str], list[Entry]]] = OrderedDict()
        self._ahead: dict[tuple[str, str], int] = {}  # (dataset, dir) → listing position read-ahead reached
        self._sweeps: dict[bytes, tuple[float, int, float]] = {}  # pack key → sweep state (planners.sweep)
        # Small files the group's peers sent and this node does not store (cluster.keep_guest off): kept in
        # memory for a while, as a directory's read-ahead brings them before their readers ask.
        self.guests = BytesLRU(config.engine.memory_budget // 8)
        removed = self.store.clean(index.has_pack)
        if removed:
            log.info("removed %d unfinished or orphaned pack file(s)", removed)

    def packable(self, entry: Entry) -> bool:
        return entry.size <= self.threshold

    def open(self, ds: Dataset, entry: Entry) -> PackedFile:
        return PackedFile(self, ds, entry, ReadStream())

    # -- local reads (any thread) ---------------------------------------------------------------------------
    def has(self, okey: bytes) -> bool:
        return (self.pending.get(okey) is not None or self.assemblies.holds(okey)
                or self.index.packed(okey) is not None or okey in self.guests)

    def local(self, ds_id: str, okey: bytes, size: int, *, wait: bool = True) -> bytes | bytearray | object | None:
        """The whole object if this node holds it (pending or packed, checksum verified), else None. Without
        ``wait``, WOULD_WAIT if reading it would wait on the disk (then call again with ``wait``)."""
        if size == 0:
            return b""
        data = self.pending.get(okey)
        if data is not None:
            return data
        assembling = self.assemblies.pending(okey)
        if assembling is not None:  # in a pack being written here
            assembly, offset, length, checksum = assembling
            with assembly.lock:
                if assembly.fd >= 0:
                    data = read_member(assembly.fd, offset, length, checksum, wait)
                    return None if data is CORRUPT else data
        loc = self.index.packed(okey)
        if loc is None:
            return self.guests.get(okey)  # (only on a miss here: packed files never pay for the guests' lock)
        pack_id, offset, length, checksum = loc
        pkey = pack_key(ds_id, pack_id)
        fd = self._open_pack(ds_id, pack_id, pkey)
        if fd is None:  # the file is gone but the index still names it (removed behind our back)
            self.index.remove_pack(ds_id, pack_id, evicted=False)
            return None
        try:
            data = read_member(fd, offset, length, checksum, wait)
            if data is not WOULD_WAIT and data is not CORRUPT and self._read_counted(pkey):
                _read_ahead(os.dup(fd))
        finally:
            self._put_back(pkey, fd)
        if data is CORRUPT:
            log.warning("pack %016x: a member failed its checksum; dropping it so it is fetched again", pack_id)
            self.index.drop_packed(ds_id, okey)
            return None
        return data

    def _read_counted(self, pkey: bytes) -> bool:
        """Count a read of pack ``pkey``; True when it is being swept (read it ahead now)."""
        self.stats.pack_read(pkey)
        with self._lock:
            if len(self._sweeps) >= 4 * _MAX_OPEN_PACKS:
                now = time.monotonic()
                self._sweeps = {k: v for k, v in self._sweeps.items() if now - v[0] < SWEEP_WINDOW}
            self._sweeps[pkey], now_ahead = sweep(self._sweeps.get(pkey), time.monotonic(), SWEEP_READS, SWEEP_WINDOW)
        return now_ahead

    def _open_pack(self, ds_id: str, pack_id: int, pkey: bytes) -> int | None:
        with self._lock:
            fd = self._fds.pop(pkey, None)  # taken out while in use: nobody closes it under us
        # An evicted pack's descriptor still reads its (immutable, checksummed) members; close_unlinked lets
        # the space go.
        return fd if fd is not None else self.store.open(ds_id, pack_id)

    def _put_back(self, pkey: bytes, fd: int) -> None:
        with self._lock:
            old = self._fds.pop(pkey, None)
            self._fds[pkey] = fd
            excess = [self._fds.popitem(last=False)[1] for _ in range(len(self._fds) - _MAX_OPEN_PACKS)]
        for stale in [old, *excess]:
            if stale is not None and stale != fd:
                os.close(stale)

    def close_all_packs(self) -> None:
        """Close every kept pack descriptor (the next read of each opens it again)."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
        for fd in fds:
            os.close(fd)

    def close_unlinked(self) -> int:
        """Close the kept descriptors of packs that were evicted (by any process), so their disk space is
        freed; returns how many. Called with the statistics flush."""
        with self._lock:
            gone = [k for k, fd in self._fds.items() if os.fstat(fd).st_nlink == 0]
            fds = [self._fds.pop(k) for k in gone]
        for fd in fds:
            os.close(fd)
        return len(fds)

    # -- fetching (event loop) ------------------------------------------------------------------------------
    async def fetch(self, ds: Dataset, okey: bytes, entry: Entry) -> tuple[bytes, bool]:
        """The whole object, fetched if no one has it (single-flight); (bytes, whether this call fetched)."""
        data = self.local(ds.ref.id, okey, entry.size)
        if data is not None:
            return data, False
        fut = self._fetches.get(okey)
        started = fut is None
        if started:
            fut = self._fetches.start(okey, self._fetch(ds, okey, entry))
        return await asyncio.shield(fut), started

    async def _fetch(self, ds: Dataset, okey: bytes, entry: Entry, held: Reservation | None = None) -> bytes:
        async with held or await self.funnel.hold(entry.size):
            data, tier = await self.chain.fetch_from(Want(ds, entry, okey, 0, entry.size))
        # A whole small object is handed to readers (and waits in its pending pack) as it is: bytes, not the
        # bytearray a source may have received the body into.
        data = data if type(data) is bytes else bytes(data)
        if not tier.kept:  # the group member that owns it keeps it
            self.guests.put(okey, data)
        elif not self.has(okey):  # (a mirror window installs what it brings itself)
            await self.pending.add(ds.ref.id, Member(okey, entry.path, entry.version, block_checksum(data), data),
                                   guest=tier.guest)
        return data

    # -- serving peers ----------------------------------------------------------------------------------------
    async def serve(self, ds: Dataset, entry: Entry, *, fetch: bool) -> tuple[bytes, int] | None:
        """The whole small file for a peer, verified, with its checksum: from this node, or with ``fetch`` (this
        node owns its directory) fetched first; None otherwise."""
        okey = object_key(ds.ref.id, entry.path, entry.version)
        data = await asyncio.to_thread(self.local, ds.ref.id, okey, entry.size)
        if data is None and fetch:
            data, _ = await self.fetch(ds, okey, entry)
        if data is None:
            return None
        data = bytes(data)
        return data, block_checksum(data)

    # -- directory read-ahead -------------------------------------------------------------------------------
    def read_ahead(self, ds: Dataset, entry: Entry) -> None:
        """After a miss on ``entry``: fetch the next small files of its directory in the background."""
        if self.readahead <= 0:
            return
        parent, _, name = entry.path.rpartition("/")
        names, entries = self._listing(ds, parent)
        key = (ds.ref.id, parent)
        plan = directory_ahead(bisect.bisect_left(names, name), self._ahead.get(key, 0), self.readahead)
        if len(self._ahead) > 4096:
            self._ahead.clear()
        reached = plan.start
        for e in entries[plan.start:plan.stop]:
            if not (e.is_dir or not self.packable(e) or e.size == 0):
                okey = object_key(ds.ref.id, e.path, e.version)
                if okey not in self._fetches and not self.has(okey):
                    held = self.funnel.try_hold(e.size)
                    if held is None:
                        break  # read-ahead uses spare memory only; the next miss carries on from here
                    self._fetches.start(okey, self._fetch_ahead(ds, okey, e, held))
            reached += 1
        self._ahead[key] = reached

    async def _fetch_ahead(self, ds: Dataset, okey: bytes, entry: Entry, held: Reservation) -> bytes:
        """:meth:`_fetch` for read-ahead, with memory held since it was queued: by the time this runs, the
        file may have come with another's mirror window or pack."""
        data = self.local(ds.ref.id, okey, entry.size)
        if data is not None:
            await held.release()
            return data
        self.stats.note_ahead((okey,))  # before its bytes are visible: a reader then counts a miss, not a hit
        return await self._fetch(ds, okey, entry, held)

    def _listing(self, ds: Dataset, parent: str) -> tuple[list[str], list[Entry]]:
        key = (ds.ref.id, ds.version, parent)
        got = self._listings.get(key)
        if got is None:
            entries = sorted(ds.listdir(parent), key=lambda e: e.path.rpartition("/")[2])
            got = self._listings[key] = ([e.path.rpartition("/")[2] for e in entries], entries)
            while len(self._listings) > _MAX_LISTINGS:
                self._listings.popitem(last=False)
        else:
            self._listings.move_to_end(key)
        return got

    def stop(self) -> list[asyncio.Future]:
        """The fetches in flight (for the caller to cancel and await)."""
        return self._fetches.runs()

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

    def __init__(self, path: PackPath, ds: Dataset, entry: Entry, stream: ReadStream | None) -> None:
        self.path, self.ds, self.entry, self.stream = path, ds, entry, stream
        self.okey = object_key(ds.ref.id, entry.path, entry.version)

    def read_local(self, start: int, end: int, *, wait: bool = True) -> bytes | bytearray | object | None:
        end = min(end, self.entry.size)
        if start >= end:
            return b""
        stream, path = self.stream, self.path
        member = stream.member if stream is not None else None
        if member is not None and member[0] == self.okey:
            whole = member[1]
            if end == len(whole):
                stream.member = None  # the last piece: do not hold the bytes as long as the stream lives
        else:
            whole = path.local(self.ds.ref.id, self.okey, self.entry.size, wait=wait)
            if whole is None or whole is WOULD_WAIT:
                return whole
            self._keep_member(whole, start, end)
        ahead = path.stats.take_ahead(self.okey)
        path.count(self.ds, self.entry, stream, hit=0 if ahead else end - start, miss=end - start if ahead else 0)
        return whole[start:end] if (start, end) != (0, len(whole)) else whole

    async def read(self, start: int, end: int) -> bytes:
        end = min(end, self.entry.size)
        if start >= end:
            return b""
        path = self.path
        whole, fetched = await path.fetch(self.ds, self.okey, self.entry)
        self._keep_member(whole, start, end)
        miss = path.stats.take_ahead(self.okey) or fetched
        path.count(self.ds, self.entry, self.stream, hit=0 if miss else end - start, miss=end - start if miss else 0)
        if fetched and self.stream is not None:
            path.read_ahead(self.ds, self.entry)
        return whole[start:end]

    def _keep_member(self, whole: bytes, start: int, end: int) -> None:
        """Keep the bytes on the stream when this read took only part of them (more pieces follow)."""
        if self.stream is not None and end - start < len(whole):
            self.stream.member = (self.okey, whole)

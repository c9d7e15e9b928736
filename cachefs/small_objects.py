"""Small objects: fetched whole in one GET, kept in pack files, read back with one ``pread``.

Objects of at most ``cache.pack_threshold`` bytes take this path instead of the block path. A fetched object is
served to its reader at once and joins its dataset's *pending* pack in memory (readable by this process from
there); a pack is written (:class:`~cachefs.store.packs.PackStore`) when it reaches ``cache.pack_size`` or one
second after its last addition, and only then does the index point the members at it, so other processes
find every member either nowhere (they fetch it too: same version, same bytes) or in a complete pack.

Reads verify the member's xxh3 every time (a member is at most ``pack_threshold`` bytes, so that is cheaper
than remembering what was verified); a mismatch drops the member from the index and it is fetched again.

Pack read-ahead: a single member is read with exactly one ``pread`` (the device's read-ahead is off for packs,
see :meth:`PackStore.open`), but a pack that several different reads hit within a few seconds is being swept (an
epoch over the dataset, a directory read in order), and the whole pack is then read into the page cache in one
sequential pass, so its other members cost no disk request each — the advantage of a pack over a file per object.

Directory read-ahead: when a reader misses on a small file, the next ``engine.dir_readahead`` small files of
the same directory (in listing order) are fetched in the background, with spare memory budget only, so a
directory read in order is fetched ahead of its reader. Each directory's listing is cached for this.
"""

from __future__ import annotations

import asyncio
import bisect
import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from ._aio import single_flight
from .checksum import block_checksum
from .errors import CacheFSError, CacheFullError
from .index.records import PackRecord, pack_key
from .mirror_fetch import MirrorFetcher
from .store.packs import Member, PackStore
from .types import Entry

if TYPE_CHECKING:
    from .engine import Dataset, Engine

__all__ = ["WOULD_WAIT", "SmallObjects"]

log = logging.getLogger(__name__)

#: Seconds after the last addition before a pending pack is written even if it is not full.
FLUSH_DELAY = 1.0
_MAX_OPEN_PACKS = 256
#: A pack read this many times within SWEEP_WINDOW seconds is read ahead whole (see the module docstring).
SWEEP_READS = 3
SWEEP_WINDOW = 5.0
_READ_AHEAD_PIECE = 2 * 1024 * 1024
_MAX_LISTINGS = 64
#: What a pack adds to its members' bytes (Arrow's header, schema and footer), and per member (its path,
#: version, checksum, offsets and padding): an upper bound, for asking the disk for room before writing.
_PACK_OVERHEAD = 4096
_MEMBER_OVERHEAD = 40


def _member_bytes(m: Member) -> int:
    return len(m.data) + len(m.path) + len(m.version) + _MEMBER_OVERHEAD


def _pack_bytes(members: list[Member]) -> int:
    return _PACK_OVERHEAD + sum(_member_bytes(m) for m in members)


class _WouldWait:
    def __repr__(self) -> str:
        return "WOULD_WAIT"


#: What a local read that must not wait answers when the bytes are on this node but not in the page cache.
WOULD_WAIT = _WouldWait()
_nowait_reads = hasattr(os, "RWF_NOWAIT")


def _read_ahead(fd: int) -> None:
    """Read the whole file into the page cache, from a thread of its own (the kernel submits the reads
    before WILLNEED returns, and they can wait for the device's queue); closes ``fd``. One WILLNEED reads at most
    the device's read-ahead maximum, so the file is asked for in pieces."""
    def run() -> None:
        try:
            size = os.fstat(fd).st_size
            for start in range(0, size, _READ_AHEAD_PIECE):
                os.posix_fadvise(fd, start, _READ_AHEAD_PIECE, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    threading.Thread(target=run, name="cachefs-pack-readahead", daemon=True).start()


_CORRUPT = object()  # what _read_member answers for a member that failed its checksum


def _read_member(fd: int, offset: int, length: int, checksum: int, wait: bool) -> bytes | bytearray | object:
    """A member's bytes, verified; WOULD_WAIT (only without ``wait``) or _CORRUPT."""
    data = os.pread(fd, length, offset) if wait else _pread_cached(fd, length, offset)
    if data is None:
        return WOULD_WAIT
    return data if len(data) == length and block_checksum(data) == checksum else _CORRUPT


def _pread_cached(fd: int, length: int, offset: int) -> bytes | bytearray | None:
    """``length`` bytes at ``offset`` if the page cache holds them all now, else None (a read would wait on
    the disk)."""
    global _nowait_reads
    if not _nowait_reads:
        return os.pread(fd, length, offset)
    buf = bytearray(length)
    try:
        n = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        _nowait_reads = False  # a file system without RWF_NOWAIT: always read (and maybe wait)
        return os.pread(fd, length, offset)
    return buf if n == length else None


class SmallObjects:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        c = engine.config.cache
        self.threshold, self.pack_size = c.pack_threshold, c.pack_size
        self.readahead = engine.config.engine.dir_readahead
        self.store = PackStore(c.dir)
        self._lock = threading.Lock()  # pending members and open packs are used from FUSE threads too
        self._pending: dict[str, list[Member]] = {}  # dataset id → members of its next pack
        self._pending_bytes: dict[str, int] = {}
        self._pending_data: dict[bytes, bytes] = {}  # object key → bytes, until its pack is in the index
        self._unwritten = 0  # bytes pending or being written
        self._written: asyncio.Event | None = None
        self._writes: set[asyncio.Task] = set()
        self._flush_timer: asyncio.TimerHandle | None = None
        self._fds: OrderedDict[bytes, int] = OrderedDict()  # pack key → descriptor
        self._inflight: dict[bytes, asyncio.Future] = {}
        self._listings: OrderedDict[tuple[str, int, str], tuple[list[str], list[Entry]]] = OrderedDict()
        self._ahead: dict[tuple[str, str], int] = {}  # (dataset, dir) → listing position read-ahead reached
        self._pack_access: dict[bytes, list] = {}  # pack key → [last access, hits] not yet in the index
        self._sweeps: dict[bytes, list] = {}  # pack key → [window start, reads in it, read ahead at]
        #: Set while pack writes fail for lack of space (cleared by the next one that succeeds).
        self.full_error: CacheFullError | None = None
        #: Files read-ahead brought (directory read-ahead, the rest of a mirror window) that no reader was
        #: served yet: their first read is a miss, the origin was read for it (see :meth:`take_ahead`).
        self._came_ahead: set[bytes] = set()
        self.mirror = MirrorFetcher(self)
        removed = self.store.clean(engine.index.has_pack)
        if removed:
            log.info("removed %d unfinished or orphaned pack file(s)", removed)

    def packable(self, entry: Entry) -> bool:
        return entry.size <= self.threshold

    def note_ahead(self, okeys) -> None:
        """These files came by read-ahead (not while a prefetch runs: what it brings is cached on purpose)."""
        if self.engine.prefetching_since is None:
            if len(self._came_ahead) > 1 << 20:  # bounded; forgetting one only counts its first read as a hit
                self._came_ahead.clear()
            self._came_ahead.update(okeys)

    def take_ahead(self, okey: bytes) -> bool:
        """Whether ``okey`` came by read-ahead and this is its first read (then no longer)."""
        if not self._came_ahead or okey not in self._came_ahead:
            return False
        self._came_ahead.discard(okey)
        return True

    # -- local reads (any thread) -------------------------------------------------------------------------
    def has(self, okey: bytes) -> bool:
        with self._lock:
            if okey in self._pending_data:
                return True
        return self.mirror.holds(okey) or self.engine.index.packed(okey) is not None

    def local(self, ds_id: str, okey: bytes, size: int, *, wait: bool = True) -> bytes | bytearray | None:
        """The whole object if this node holds it (pending or packed, checksum verified), else None. Without
        ``wait``, WOULD_WAIT if reading it would wait on the disk (then call again with ``wait``)."""
        if size == 0:
            return b""
        with self._lock:
            data = self._pending_data.get(okey)
        if data is not None:
            return data
        assembling = self.mirror.pending(okey)
        if assembling is not None:  # in a mirror pack being written here
            assembly, offset, length, checksum = assembling
            with assembly.lock:
                if assembly.fd >= 0:
                    data = _read_member(assembly.fd, offset, length, checksum, wait)
                    return None if data is _CORRUPT else data
        loc = self.engine.index.packed(okey)
        if loc is None:
            return None
        pack_id, offset, length, checksum = loc
        pkey = pack_key(ds_id, pack_id)
        fd = self._open_pack(ds_id, pack_id, pkey)
        if fd is None:  # the file is gone but the index still names it (removed behind our back)
            self.engine.index.remove_pack(ds_id, pack_id)
            return None
        try:
            data = _read_member(fd, offset, length, checksum, wait)
            if data is not WOULD_WAIT and data is not _CORRUPT and self._count_read(pkey):
                _read_ahead(os.dup(fd))
        finally:
            self._put_back(pkey, fd)
        if data is _CORRUPT:
            log.warning("pack %016x: a member failed its checksum; dropping it so it is fetched again", pack_id)
            self.engine.index.drop_packed(ds_id, okey)
            return None
        return data

    def _count_read(self, pkey: bytes) -> bool:
        """Count a read of pack ``pkey`` (its access for the index, and its sweep); True once when it is being
        swept (then again a window later)."""
        now = time.monotonic()
        with self._lock:
            acc = self._pack_access.setdefault(pkey, [0.0, 0])
            acc[0], acc[1] = time.time(), acc[1] + 1
            sweep = self._sweeps.get(pkey)
            if sweep is None:
                if len(self._sweeps) >= 4 * _MAX_OPEN_PACKS:
                    self._sweeps = {k: v for k, v in self._sweeps.items() if now - v[0] < SWEEP_WINDOW}
                sweep = self._sweeps[pkey] = [now, 0, -SWEEP_WINDOW]
            elif now - sweep[0] > SWEEP_WINDOW:
                sweep[0], sweep[1] = now, 0
            sweep[1] += 1
            if sweep[1] < SWEEP_READS or now - sweep[2] < SWEEP_WINDOW:
                return False
            sweep[2] = now
            return True

    def take_pack_access(self) -> dict[bytes, tuple[float, int]]:
        """Pack accesses (last access, hits) since the last call, for the index."""
        with self._lock:
            taken, self._pack_access = self._pack_access, {}
        return {k: (last, hits) for k, (last, hits) in taken.items()}

    def _open_pack(self, ds_id: str, pack_id: int, pkey: bytes) -> int | None:
        with self._lock:
            fd = self._fds.pop(pkey, None)  # taken out while in use: nobody closes it under us
        # An evicted pack's descriptor still reads its (immutable, checksummed) members; close_unlinked lets
        # the space go.
        return fd if fd is not None else self.store.open(ds_id, pack_id)

    def close_unlinked(self) -> int:
        """Close the kept descriptors of packs that were evicted (by any process), so their disk space is
        freed; returns how many. Called with the statistics flush."""
        with self._lock:
            gone = [k for k, fd in self._fds.items() if os.fstat(fd).st_nlink == 0]
            fds = [self._fds.pop(k) for k in gone]
        for fd in fds:
            os.close(fd)
        return len(fds)

    def _put_back(self, pkey: bytes, fd: int) -> None:
        with self._lock:
            old = self._fds.pop(pkey, None)
            self._fds[pkey] = fd
            excess = [self._fds.popitem(last=False)[1] for _ in range(len(self._fds) - _MAX_OPEN_PACKS)]
        for stale in [old, *excess]:
            if stale is not None and stale != fd:
                os.close(stale)

    def close_pack(self, pkey: bytes) -> None:
        with self._lock:
            fd = self._fds.pop(pkey, None)
        if fd is not None:
            os.close(fd)

    # -- fetching (event loop) ----------------------------------------------------------------------------
    async def fetch(self, ds: Dataset, okey: bytes, entry: Entry) -> tuple[bytes, bool]:
        """The whole object, fetched if no one has it (single-flight); (bytes, whether this call fetched)."""
        data = self.local(ds.ref.id, okey, entry.size)
        if data is not None:
            return data, False
        fut = self._inflight.get(okey)
        if fut is None:
            fut = single_flight(self._inflight, okey, self._fetch(ds, okey, entry))
            return await asyncio.shield(fut), True
        return await asyncio.shield(fut), False

    async def _fetch(self, ds: Dataset, okey: bytes, entry: Entry, *, reserved: bool = False) -> bytes:
        mirror = await self.mirror.mirror(ds)
        if mirror is not None and okey in mirror.entries:
            try:
                data = await self.mirror.fetch(ds, mirror, okey)
            except CacheFSError as exc:  # a mirror rewritten or damaged: the source still has the file
                log.warning("%s: %s; reading %s from the source", mirror.url, exc, entry.path)
            else:
                if reserved:
                    await self.engine.budget.release(entry.size)
                return data
        data = await self.fetch_whole(ds, entry, reserved=reserved)
        await self._add(ds.ref.id, Member(okey, entry.path, entry.version, block_checksum(data), data))
        return data

    async def fetch_whole(self, ds: Dataset, entry: Entry, *, reserved: bool = False) -> bytes:
        """The whole object from the origin, under the memory budget (``reserved``: already held for it)."""
        budget = self.engine.budget
        if not reserved:
            await budget.acquire(entry.size)
        try:
            data = await self.engine.origin_read(ds, entry, 0, entry.size)
        finally:
            await budget.release(entry.size)
        # A whole small object is handed to readers (and waits in its pending pack) as it is: bytes, not the
        # bytearray a source may have received the body into.
        return data if type(data) is bytes else bytes(data)

    async def _add(self, ds_id: str, member: Member) -> None:
        with self._lock:
            self._pending_data[member.okey] = member.data
            self._pending.setdefault(ds_id, []).append(member)
            pending = self._pending_bytes[ds_id] = self._pending_bytes.get(ds_id, 0) + len(member.data)
            self._unwritten += len(member.data)
            full = pending >= self.pack_size
        if full:
            self._start_write(ds_id)
        elif self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(FLUSH_DELAY, self._flush_soon)
        # Back-pressure: at most two packs' worth of fetched bytes wait for the disk.
        while self._unwritten > 2 * self.pack_size:
            if self._written is None:
                self._written = asyncio.Event()
            self._written.clear()
            if not self._writes:
                for ds in list(self._pending):
                    self._start_write(ds)
            await self._written.wait()

    def _flush_soon(self) -> None:
        self._flush_timer = None
        for ds_id in list(self._pending):
            self._start_write(ds_id)

    def _take(self, ds_id: str) -> list[Member]:
        with self._lock:
            self._pending_bytes.pop(ds_id, None)
            return self._pending.pop(ds_id, [])

    def _start_write(self, ds_id: str) -> None:
        members = self._take(ds_id)
        if not members:
            return
        task = asyncio.ensure_future(self.engine.run_disk(self._write, ds_id, members))
        self._writes.add(task)

        def done(t: asyncio.Task) -> None:
            self._writes.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("writing a pack failed: %s", t.exception())  # (its members are fetched again)
            elif not t.cancelled():
                self.engine.note_stored(t.result())
            if self._written is not None:
                self._written.set()

        task.add_done_callback(done)

    def _write(self, ds_id: str, members: list[Member]) -> int:
        """Write one pack and record its members (any thread); returns bytes written. What the disk has no room
        for (see :class:`~cachefs.space.DiskSpace`) is dropped: those members were served, they are just not
        cached."""
        nbytes = sum(len(m.data) for m in members)
        dropped: list[Member] = []
        try:
            written = self._write_fitting(ds_id, members, dropped)
        finally:
            with self._lock:  # in the index now (or dropped): no longer served from memory
                for m in members:
                    self._pending_data.pop(m.okey, None)
                self._unwritten -= nbytes
        if dropped:
            self.full_error = CacheFullError(f"cache disk full: could not store {len(dropped)} small files "
                                             f"(capacity {self.engine.capacity} B)")
        else:
            self.full_error = None
        return written

    def _write_fitting(self, ds_id: str, members: list[Member], dropped: list[Member]) -> int:
        """Write as many of ``members`` (in order) as the disk has room for, as one pack; the rest go to
        ``dropped``. Room is asked for first (evicting once), so a full disk costs no failed writes."""
        space = self.engine.space
        if not space.full and not space.admits(_pack_bytes(members)):
            space.evict(_pack_bytes(members))
        room = 0 if space.full else space.room()
        fit, need = 0, _PACK_OVERHEAD
        for m in members:
            need += _member_bytes(m)
            if need > room:
                break
            fit += 1
        dropped.extend(members[fit:])
        if not fit:
            space.mark_full()
            return 0
        written = space.store(_pack_bytes(members[:fit]), lambda: self._write_pack(ds_id, members[:fit]))
        if written is None:
            dropped.extend(members[:fit])
            return 0
        return written

    def _write_pack(self, ds_id: str, members: list[Member]) -> int:
        written = self.store.write(ds_id, members)
        try:
            self.engine.index.commit_pack(ds_id, written.pack_id, written.size, written.members)
        except CacheFSError:
            self.store.remove(ds_id, written.pack_id)  # never a pack file the index does not know
            raise
        return written.size

    async def flush(self) -> None:
        """Write every pending pack now and wait for all writes (mirror packs on the wire included)."""
        await self.mirror.flush()
        for ds_id in list(self._pending):
            self._start_write(ds_id)
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def flush_sync(self) -> None:
        """:meth:`flush` for callers without the event loop (shutdown)."""
        for ds_id in list(self._pending):
            members = self._take(ds_id)
            if members:
                self._write(ds_id, members)
        self.mirror.close()

    # -- directory read-ahead -----------------------------------------------------------------------------
    def read_ahead(self, ds: Dataset, entry: Entry) -> None:
        """After a miss on ``entry``: fetch the next small files of its directory in the background."""
        if self.readahead <= 0:
            return
        parent = entry.path.rpartition("/")[0]
        names, entries = self._listing(ds, parent)
        pos = bisect.bisect_left(names, entry.path.rpartition("/")[2])
        key = (ds.ref.id, parent)
        prev = self._ahead.get(key, 0)
        reached = prev if pos + 1 <= prev <= pos + 1 + self.readahead else pos + 1
        if len(self._ahead) > 4096:
            self._ahead.clear()
        budget = self.engine.budget
        for e in entries[reached:pos + 1 + self.readahead]:
            if not (e.is_dir or not self.packable(e) or e.size == 0):
                okey = self.engine.object_key(ds, e)
                if okey not in self._inflight and not self.has(okey):
                    if not budget.try_reserve(e.size):
                        break  # read-ahead uses spare budget only; the next miss carries on from here
                    single_flight(self._inflight, okey, self._fetch_ahead(ds, okey, e))
            reached += 1
        self._ahead[key] = reached

    async def _fetch_ahead(self, ds: Dataset, okey: bytes, entry: Entry) -> bytes:
        """:meth:`_fetch` for read-ahead, which reserved ``entry.size`` of budget when it queued the file: by
        the time this runs, the file may have come with another's mirror window or pack."""
        data = self.local(ds.ref.id, okey, entry.size)
        if data is not None:
            await self.engine.budget.release(entry.size)
            return data
        data = await self._fetch(ds, okey, entry, reserved=True)
        self.note_ahead((okey,))
        return data

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

    # -- eviction -----------------------------------------------------------------------------------------
    def remove_pack(self, rec: PackRecord) -> int:
        """Evict one pack: the index forgets it and its members, then the file goes. Returns bytes freed."""
        freed = self.engine.index.remove_pack(rec.dataset, rec.pack_id)
        self.close_pack(rec.key())
        self.store.remove(rec.dataset, rec.pack_id)
        return freed

"""The read-through engine: manifest → index → local store → origin.

How a read is served
--------------------
A read names a dataset, a manifest entry (path, size, version) and a byte range. The range is split into
fixed-size blocks. Blocks the index lists as present are read from the object's local file and verified
against their xxh3 (once per open handle). Missing blocks are fetched from the origin with a ranged GET
pinned to the entry's version, at most once at a time per block in this process (*single-flight*: a
hundred readers of one cold block cause one GET and share its bytes), written to the local file, and only
then recorded in the index. Other processes on the node see the record and read the file; they may
occasionally fetch the same block too (harmless: same version, same bytes, same offset).

Sequential readers get read-ahead: each :class:`ReadStream` that keeps reading where it stopped doubles its
window (1, 2, 4, … blocks, up to ``engine.readahead_max``), and the blocks ahead are fetched in the
background, but only while the memory budget has room, so read-ahead can never starve demand reads.

Everything in flight lives under one :class:`~cachefs.budget.MemoryBudget`, so the process's memory is
bounded however many readers there are.

Two doors, one path
-------------------
The async methods run on the cachefs event loop. Sync callers (fsspec files, FUSE handlers) first try
:meth:`Engine.read_local`, which serves fully present ranges from the calling thread without touching the
loop, and fall back to :meth:`Engine.read` through :func:`cachefs._aio.run_sync` on a miss. Both doors share
the same handle table, present-block maps and checksum verification.

Eviction
--------
When cached bytes pass ``high_watermark × capacity`` or the disk's free space drops under ``min_free``,
whole objects are removed until usage is under ``low_watermark × capacity``: first objects read at most once,
then the rest, least recently used first within each group (:func:`eviction_order`).
An object that a reader in any process has open (a file open through the mount or fsspec holds a shared
``flock`` on its cache file, see :meth:`Engine.pin`) is skipped. Descriptors this process merely keeps open
for speed hold nothing: an object evicted under them reads on from its unlinked file and is let go.

A full disk
-----------
Every write goes through :class:`~cachefs.space.DiskSpace`: admitted only within the capacity and the
free-space floor, after one eviction if need be. A block that cannot be stored is served anyway, and it waits
in memory (:attr:`Engine.unstored_limit` bytes at most, least recently used out) for its
readers, so a reader streaming past a full disk still gets the origin's speed.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ._memory import bound_allocator
from .budget import MemoryBudget
from .checksum import block_checksum
from .config import Config, prepare_cache_dir, resolve_size
from .errors import CacheFSError, CacheFullError, ConfigError, CorruptBlockError
from .index import DatasetRecord, Index, ObjectRecord
from .index.records import PackRecord
from .manifest import ManifestStore, take_snapshot
from .small_objects import WOULD_WAIT, SmallObjects
from .sources import Source, open_origin
from .space import DiskSpace
from .store import DiskStore, StoredObject
from .types import DatasetRef, Entry, object_key

__all__ = ["WOULD_WAIT", "Dataset", "Engine", "ReadStream", "get_engine"]

log = logging.getLogger(__name__)

#: Open object files kept per process; idle ones beyond this are closed (which also lets eviction take them).
_MAX_OPEN_OBJECTS = 1024


@dataclass
class Dataset:
    """A dataset opened at one manifest version. Metadata calls never reach the origin."""

    ref: DatasetRef
    version: int
    source: Source
    manifests: ManifestStore
    record: DatasetRecord

    def stat(self, path: str) -> Entry:
        return self.manifests.lookup(self.ref.id, self.version, _norm(path))

    def listdir(self, path: str = "") -> list[Entry]:
        return list(self.manifests.listdir(self.ref.id, self.version, _norm(path)))

    def walk_files(self, path: str = "") -> Iterator[Entry]:
        return self.manifests.walk_files(self.ref.id, self.version, _norm(path))

    def file(self, path: str) -> Entry:
        entry = self.stat(path)
        if entry.is_dir:
            raise IsADirectoryError(21, f"{path}: is a directory")
        return entry


def _norm(path: str) -> str:
    return path.strip("/")


@dataclass
class ReadStream:
    """Per-open-file read state: where the last read ended and how far ahead to fetch."""

    next_offset: int = 0
    window: int = 0  # blocks
    #: Whether this stream's access was counted yet (an object's hit count is the number of accesses, i.e.
    #: opens, not of read calls, so a file read in many small reads is still one access).
    counted: bool = False
    #: Blocks below this index were already handed to read-ahead from a local read (see Engine._keep_ahead).
    ahead_to: int = 0
    #: (object key, bytes) of the packed file this stream reads in pieces: a packed file is read and verified
    #: whole, so each later piece is a slice of it, not another read and checksum of the whole member (the
    #: kernel asks for a page-cached file in read-ahead pieces of 128 KiB: 8 whole reads of a 1 MiB file).
    member: tuple[bytes, bytes] | None = None


@dataclass
class _Open:
    stored: StoredObject
    record: ObjectRecord
    present: dict[int, tuple[int, int]]
    refs: int = 0
    nblocks: int = 0
    hits: int = 0
    last_access: float = field(default_factory=time.time)
    #: Pins and block writes under way: while above zero the file is held (flock) against eviction.
    holds: int = 0
    #: The file was evicted under this handle: it reads on (every block in ``present`` is whole in it) but is
    #: no longer in the table, takes no writes, and is closed once nobody uses it.
    stale: bool = False
    #: Blocks read-ahead brought that no reader has been served yet (their first serving counts as a miss).
    ahead: set[int] = field(default_factory=set)


class Engine:
    """One per cache directory per process (see :func:`get_engine`)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        c = config.cache
        prepare_cache_dir(c.dir)
        self.block_size = c.block_size
        self.index = Index(c.dir)
        self.store = DiskStore(c.dir, c.block_size)
        self.manifests = ManifestStore(self.index)
        disk_total, disk_free = self.store.disk_usage()
        self.capacity = resolve_size(c.capacity, disk_total, "cache.capacity")
        self.min_free = resolve_size(c.min_free, disk_total, "cache.min_free")
        self.index.keep_reserve(disk_total, disk_free - self.min_free)  # see cachefs/index/reserve.py
        self.budget = MemoryBudget(config.engine.memory_budget)
        self.space = DiskSpace(capacity=self.capacity, min_free=self.min_free, used=lambda: self.index.totals()[0],
                               disk=self.store.disk_usage,
                               evict=lambda need: self.evict_sync(force=True, need=need))
        # Disk writes and evictions run here rather than in asyncio's default executor, so that closing the
        # engine can wait for every write still running before it closes the files they write to.
        self._disk = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="cachefs-disk")
        self._disk_jobs: set[concurrent.futures.Future] = set()
        #: Read-ahead blocks that a full disk could not take, kept for their reader (see "A full disk").
        self.unstored_limit = min(config.engine.readahead_max, config.engine.memory_budget // 4)
        self._unstored: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()
        self._unstored_bytes = 0
        self._closing = False
        #: Set (epoch seconds) while a prefetch runs in this process. Objects and packs used since then are not
        #: evicted, so that a selection larger than the cache fails clearly instead of evicting what it just
        #: fetched; and files it brings are not read-ahead (a later read of them is a hit, not a miss).
        self.prefetching_since: float | None = None
        # Limits are checked (an index read and a statvfs) every this many stored bytes rather than per block:
        # half the room between the high watermark and the capacity, so usage still never passes capacity.
        self._check_every = max(1, min(64 * 1024 * 1024, int(self.capacity * (1 - c.high_watermark) / 2)))
        self._stored_since_check = 0
        if config.engine.bound_allocator:
            bound_allocator(min(c.block_size, 4 * 1024 * 1024))
        self._window = MemoryBudget(config.engine.fetch_window)  # bytes on the wire
        self._fetch_slots: asyncio.Semaphore | None = None
        self._open: OrderedDict[bytes, _Open] = OrderedDict()
        self._open_lock = threading.RLock()
        self._inflight: dict[tuple[bytes, int], asyncio.Task] = {}
        self._sources: dict[tuple, Source] = {}
        self._first_snapshot: dict[str, asyncio.Lock] = {}
        self._ds_stats: dict[str, list[int]] = {}  # dataset id -> [hit bytes, miss bytes] not yet flushed
        self._obj_stats: dict[bytes, tuple[float, int]] = {}  # object key -> (last access, hits) not yet flushed
        self._stats_lock = threading.Lock()
        self._stats_task: asyncio.Task | None = None
        self._evicting: asyncio.Task | None = None
        self._background: set[asyncio.Future] = set()  # read-ahead tasks (awaited by aclose)
        self._dir_hits: dict[tuple[str, str], int] = {}  # (dataset id, directory) -> accesses not yet flushed
        self.small = SmallObjects(self)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the async core runs on
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        from . import _aio

        loop = _aio.get_loop() if self._sources else None
        if loop is not None and loop.is_running():
            try:
                _aio.run_sync(self.aclose(), timeout=5)
                return
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                pass
        self.close()

    # -- datasets -----------------------------------------------------------------------------------------
    def source_for(self, url: str, storage_options: dict[str, Any] | None = None) -> Source:
        key = (url.split("://", 1)[0], repr(sorted((storage_options or {}).items())))
        src = self._sources.get(key)
        if src is None:
            src = self._sources[key] = open_origin(url, self.config, storage_options)
        return src

    async def open_dataset(
        self, url: str, *, storage_options: dict[str, Any] | None = None, manifest_version: int | None = None,
        source: Source | None = None,
    ) -> Dataset:
        """Open a dataset, taking its first manifest if the node has none. No origin request otherwise."""
        self._loop = asyncio.get_running_loop()  # where threads serving local reads start read-ahead
        ref = DatasetRef.from_url(url)
        src = source or self.source_for(ref.url, storage_options)
        rec = self.index.dataset(ref.id)
        if rec is None or not rec.manifests:
            async with self._first_snapshot.setdefault(ref.id, asyncio.Lock()):  # one listing per process
                rec = await take_snapshot(self.index, src, ref, only_if_missing=True)
        version = rec.current if manifest_version is None else int(manifest_version)
        if rec.manifest(version) is None:
            have = ", ".join(str(m.version) for m in rec.manifests) or "none"
            raise ConfigError(f"{ref.url}: manifest version {version} is not on this node (have: {have})")
        return Dataset(ref, version, src, self.manifests, rec)

    async def refresh(self, url: str, *, storage_options: dict[str, Any] | None = None,
                      source: Source | None = None) -> DatasetRecord:
        """Take a new manifest snapshot; readers that open the dataset afterwards see it."""
        ref = DatasetRef.from_url(url)
        return await take_snapshot(self.index, source or self.source_for(ref.url, storage_options), ref)

    def known_dataset_for(self, url: str) -> DatasetRecord | None:
        """The dataset on this node whose URL is the longest prefix of ``url``."""
        best = None
        for rec in self.index.datasets():
            if (url == rec.url or url.startswith(rec.url + "/")) and (best is None or len(rec.url) > len(best.url)):
                best = rec
        return best

    # -- open objects -------------------------------------------------------------------------------------
    def _acquire(self, ds: Dataset, entry: Entry) -> _Open:
        okey = object_key(ds.ref.id, entry.path, entry.version)
        with self._open_lock:
            ob = self._open.get(okey)
            if ob is None:
                stored = self.store.open(okey, ds.ref.id, entry.size)
                rec = ObjectRecord(ds.ref.id, entry.path, entry.version, entry.size, block_size=self.block_size)
                nblocks = -(-entry.size // self.block_size)
                ob = _Open(stored, rec, self.index.blocks_of(okey), nblocks=nblocks)
                self._open[okey] = ob
                self._trim_open()
            else:
                self._open.move_to_end(okey)
            ob.refs += 1
            return ob

    def _release(self, ob: _Open) -> None:
        with self._open_lock:
            ob.refs -= 1
            if ob.stale and ob.refs <= 0 and ob.holds <= 0:
                ob.stored.close()

    def _hold(self, ob: _Open) -> bool:
        """Hold ``ob``'s file against eviction (see :meth:`pin`); False if it was evicted (``ob`` is stale
        then: it reads on, but nothing may be written to it or recorded for it)."""
        with self._open_lock:
            if ob.stale:
                return False
            if ob.holds == 0 and not ob.stored.hold():
                self._mark_stale(ob)
                return False
            ob.holds += 1
            return True

    def _unhold(self, ob: _Open) -> None:
        with self._open_lock:
            ob.holds -= 1
            if ob.holds == 0:
                if ob.stale:
                    if ob.refs <= 0:
                        ob.stored.close()
                else:
                    ob.stored.unhold()

    def _mark_stale(self, ob: _Open) -> None:
        """``ob``'s file was evicted by some process: take it out of the table (the next use opens the new
        file). Call with ``_open_lock`` held."""
        if ob.stale:
            return
        ob.stale = True
        okey = ob.stored.key
        if self._open.get(okey) is ob:
            del self._open[okey]
            self._note_access(okey, ob)
        if ob.refs <= 0 and ob.holds <= 0:
            ob.stored.close()

    def pin(self, ds: Dataset, entry: Entry) -> object | None:
        """Keep ``entry``'s cache file from eviction by any process until :meth:`unpin` (a reader has the file
        open). Packed small files need no pin (a pack is read on after eviction); None for them."""
        if self.small.packable(entry):
            return None
        for _ in range(3):
            ob = self._acquire(ds, entry)
            if self._hold(ob):
                return ob
            self._release(ob)  # evicted while idle here: the next acquire opens its new file
        return None

    def unpin(self, pin: object | None) -> None:
        if pin is not None:
            self._unhold(pin)
            self._release(pin)

    def _trim_open(self) -> None:
        excess = len(self._open) - _MAX_OPEN_OBJECTS
        if excess <= 0:
            return
        # The least recently used handles are at the front; look a little past the excess in case some are busy.
        for okey in list(itertools.islice(self._open, excess + 32)):
            if len(self._open) <= _MAX_OPEN_OBJECTS:
                break
            ob = self._open[okey]
            if ob.refs == 0:
                self._close_open(okey, ob)

    def _close_open(self, okey: bytes, ob: _Open) -> None:
        del self._open[okey]
        self._note_access(okey, ob)
        ob.stored.close()
        if not ob.present:  # opened but never filled: do not leave an empty file the index does not know
            self.store.try_remove(okey, ob.record.dataset, lambda: self.index.object(okey) is None)

    def close_evicted(self) -> int:
        """Close the idle descriptors of objects some process evicted (their space comes back); returns how
        many. Called with the statistics flush."""
        with self._open_lock:
            gone = [(k, ob) for k, ob in self._open.items() if ob.refs == 0 and not ob.stored.linked()]
            for okey, ob in gone:
                self._close_open(okey, ob)
        return len(gone)

    def _has(self, ob: _Open, idx: int) -> bool:
        if idx in ob.present:
            return True
        got = self.index.block(ob.stored.key, idx)  # another process may have fetched it
        if got is not None:
            if not ob.stored.linked():  # into the object's new file, not this evicted one
                with self._open_lock:
                    self._mark_stale(ob)
                return False
            ob.present[idx] = got
            return True
        return False

    def local_path(self, ds: Dataset, entry: Entry) -> str | None:
        """Path of the complete local file of ``entry``, or None if some block is missing (or it is packed,
        or evicted)."""
        if self.small.packable(entry):
            return None
        ob = self._acquire(ds, entry)
        try:
            if all(self._has(ob, i) for i in range(ob.nblocks)) and ob.stored.linked():
                return ob.stored.path
            return None
        finally:
            self._release(ob)

    def local_fd(self, pin: object) -> int | None:
        """A new read-only descriptor of a pinned object's cache file if every block is present, else None:
        what FUSE passthrough hands the kernel (a descriptor, not a path that eviction could swap)."""
        ob = pin
        if not all(self._has(ob, i) for i in range(ob.nblocks)) or ob.stale:
            return None
        import os

        return os.open(f"/proc/self/fd/{ob.stored.fileno()}", os.O_RDONLY | os.O_CLOEXEC)

    # -- reads --------------------------------------------------------------------------------------------
    def read_local(self, ds: Dataset, entry: Entry, start: int, end: int, stream: ReadStream | None = None, *,
                   wait: bool = True) -> bytes | None:
        """Serve ``[start, end)`` from local blocks only, from the calling thread; None if any is missing.
        Without ``wait``, a packed small file that is not in the page cache is WOULD_WAIT (a thread that must
        not wait on the disk calls again from elsewhere); the result may then be a bytearray."""
        end = min(end, entry.size)
        if start >= end:
            return b""
        if self.small.packable(entry):
            okey = self.object_key(ds, entry)
            member = stream.member if stream is not None else None
            if member is not None and member[0] == okey:
                whole = member[1]
                if end == len(whole):
                    stream.member = None  # the last piece: do not hold the bytes as long as the stream lives
            else:
                whole = self.small.local(ds.ref.id, okey, entry.size, wait=wait)
                if whole is None or whole is WOULD_WAIT:
                    return whole
                _keep_member(stream, okey, whole, start, end)
            ahead = self.small.take_ahead(okey)
            self._count_small(ds, entry, stream, hit=0 if ahead else end - start, miss=end - start if ahead else 0)
            return whole[start:end] if (start, end) != (0, len(whole)) else whole
        ob = self._acquire(ds, entry)
        try:
            bs = self.block_size
            if not all(self._has(ob, i) for i in range(start // bs, (end - 1) // bs + 1)):
                return None
            try:
                data = ob.stored.read(start, end, ob.present)
            except CorruptBlockError as exc:
                self._drop_corrupt(ob, exc)
                return None
            ahead = self._take_ahead(ob, start, end) if ob.ahead else 0
            self._count(ob, ds.ref.id, stream, hit=len(data) - ahead, miss=ahead)
            if stream is not None:
                self._advance(stream, start, end)
                if stream.window:
                    self._keep_ahead(ds, entry, ob, stream)
            return data
        finally:
            self._release(ob)

    def _keep_ahead(self, ds: Dataset, entry: Entry, ob: _Open, stream: ReadStream) -> None:
        """From a thread serving local reads: have the cachefs loop fetch what is missing in the read-ahead
        window. Only the async path starts read-ahead, so a sequential reader served locally (the cached part
        of a file, or blocks read ahead earlier) would otherwise run into the next missing block and wait for
        a whole window to be fetched: through FUSE, half-cached files read at 0.33 GB/s, the engine 0.88."""
        bs = self.block_size
        nxt = -(-stream.next_offset // bs)
        stop = min(ob.nblocks, nxt + stream.window)
        if stop <= stream.ahead_to:
            return
        lo, stream.ahead_to = max(nxt, stream.ahead_to), stop
        loop = self._loop
        if loop is None or loop.is_closed() or all(i in ob.present for i in range(lo, stop)):
            return
        loop.call_soon_threadsafe(self._read_ahead_soon, ds, entry, stream)

    def _read_ahead_soon(self, ds: Dataset, entry: Entry, stream: ReadStream) -> None:
        ob = self._acquire(ds, entry)
        try:
            self._read_ahead(ds, entry, ob, stream)
        finally:
            self._release(ob)

    async def read(self, ds: Dataset, entry: Entry, start: int, end: int, stream: ReadStream | None = None
                   ) -> bytes:
        """Bytes ``[start, end)`` of ``entry`` (clamped to its size), fetching what is missing."""
        end = min(end, entry.size)
        if start >= end:
            return b""
        self._start_background()
        if self.small.packable(entry):
            okey = self.object_key(ds, entry)
            whole, fetched = await self.small.fetch(ds, okey, entry)
            _keep_member(stream, okey, whole, start, end)
            miss = self.small.take_ahead(okey) or fetched
            self._count_small(ds, entry, stream, hit=0 if miss else end - start, miss=end - start if miss else 0)
            if fetched and stream is not None:
                self.small.read_ahead(ds, entry)
            return whole[start:end]
        ob = self._acquire(ds, entry)
        try:
            bs = self.block_size
            first, last = start // bs, (end - 1) // bs
            for _attempt in range(3):
                missing = [i for i in range(first, last + 1) if not self._has(ob, i)]
                fetched: dict[int, bytes] = {}
                if missing:
                    fetched = self._take_unstored(ob.stored.key, missing)
                    missing = [i for i in missing if i not in fetched]
                    got = await asyncio.gather(*(self._block(ds, entry, ob, i) for i in missing))
                    fetched.update((i, b) for i, b in zip(missing, got, strict=True) if b is not None)
                try:
                    data = self._assemble(ob, start, end, fetched)
                    break
                except CorruptBlockError as exc:
                    self._drop_corrupt(ob, exc)
            else:
                raise CorruptBlockError(f"{entry.path}: blocks keep failing their checksums; is the cache disk healthy?")
            fetched_bytes = self._take_ahead(ob, start, end) if ob.ahead else 0
            fetched_bytes += sum(min(end, (i + 1) * bs) - max(start, i * bs) for i in fetched)
            if last in fetched and end < min((last + 1) * bs, entry.size):
                ob.ahead.add(last)  # the rest of that block came for this reader too: a miss when it gets there
            self._count(ob, ds.ref.id, stream, hit=max(0, len(data) - fetched_bytes),
                        miss=min(len(data), fetched_bytes))
            if stream is not None:
                self._advance(stream, start, end)
                self._read_ahead(ds, entry, ob, stream)
            return data
        finally:
            self._release(ob)

    def _assemble(self, ob: _Open, start: int, end: int, fetched: dict[int, bytes]) -> bytes:
        if not fetched:
            return ob.stored.read(start, end, ob.present)
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        parts = []
        for i in range(first, last + 1):
            lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
            block = fetched.get(i)
            if block is not None:
                parts.append(memoryview(block)[lo - i * bs : hi - i * bs])
            else:
                parts.append(ob.stored.read(lo, hi, ob.present))
        return b"".join(parts)

    def _drop_corrupt(self, ob: _Open, exc: CorruptBlockError) -> None:
        idx = getattr(exc, "block", None)
        log.warning("%s; dropping the block so it is fetched again", exc)
        if idx is None:
            return
        ob.present.pop(idx, None)
        ob.stored.forget_verified(idx)
        if ob.stored.linked():  # (an evicted file's record is gone already, or names another file's block)
            self.index.drop_block(ob.stored.key, idx)

    def _advance(self, stream: ReadStream, start: int, end: int) -> None:
        max_window = self.config.engine.readahead_max // self.block_size
        stream.window = min(max(1, stream.window * 2), max_window) if start == stream.next_offset else 0
        stream.next_offset = end

    def _read_ahead(self, ds: Dataset, entry: Entry, ob: _Open, stream: ReadStream) -> None:
        if stream.window == 0:
            return
        bs = self.block_size
        nxt = -(-stream.next_offset // bs)
        if self._closing:
            return
        for i in range(nxt, min(ob.nblocks, nxt + stream.window)):
            key = (ob.stored.key, i)
            if self._has(ob, i) or key in self._inflight or key in self._unstored:
                continue
            length = min(bs, entry.size - i * bs)
            if not self.budget.try_reserve(length):
                break  # read-ahead only uses spare budget
            with self._open_lock:
                ob.refs += 1
            task = asyncio.ensure_future(self._block(ds, entry, ob, i, reserved=True, ahead=True))
            self._background.add(task)
            task.add_done_callback(lambda t, ob=ob: (self._background.discard(t), self._release(ob), _retrieve(t)))

    async def _block(self, ds: Dataset, entry: Entry, ob: _Open, idx: int, *, reserved: bool = False,
                     strict: bool = False, ahead: bool = False) -> bytes | None:
        """Make block ``idx`` present; returns its bytes if this call fetched them (single-flight). With
        ``ahead`` (read-ahead), bytes the disk cannot take are kept in memory for the reader instead."""
        key = (ob.stored.key, idx)
        task = self._inflight.get(key)
        if task is None:
            if self._has(ob, idx):
                if reserved:
                    await self.budget.release(min(self.block_size, entry.size - idx * self.block_size))
                return None
            task = asyncio.ensure_future(self._fetch(ds, entry, ob, idx, reserved=reserved))
            self._inflight[key] = task
            task.add_done_callback(lambda t: (self._inflight.pop(key, None), _retrieve(t)))
        elif reserved:
            await self.budget.release(min(self.block_size, entry.size - idx * self.block_size))
        data, stored_ok = await asyncio.shield(task)
        if strict and not stored_ok:
            raise CacheFullError(f"cache disk full: cannot store {entry.path} (capacity {self.capacity} B)")
        if not stored_ok:
            self._keep_unstored(key, data)
        elif ahead:
            ob.ahead.add(idx)
        return data

    async def origin_read(self, ds: Dataset, entry: Entry, start: int, length: int) -> bytes:
        """``length`` bytes of ``entry`` at ``start`` from the origin, within the fetch limits (concurrent GETs,
        bytes on the wire). The caller holds memory budget for them."""
        return await self.origin_get(ds.source, ds.ref.object_url(entry.path), entry.version, start, length)

    async def origin_get(self, source: Source, url: str, version: str, start: int, length: int) -> bytes:
        """:meth:`origin_read` of any object (a mirror's pack)."""
        if self._fetch_slots is None:
            self._fetch_slots = asyncio.Semaphore(self.config.engine.max_concurrent_fetches)
        async with self._fetch_slots, self._window.reserve(length):
            return await source.read(url, version, start, start + length)

    async def _fetch(self, ds: Dataset, entry: Entry, ob: _Open, idx: int, *, reserved: bool) -> tuple[bytes, bool]:
        bs = self.block_size
        start = idx * bs
        length = min(bs, entry.size - start)
        if not reserved:
            await self.budget.acquire(length)
        try:
            data = await self.origin_read(ds, entry, start, length)
            stored = await self._store_block(ob, idx, data, block_checksum(data))
        finally:
            await self.budget.release(length)
        return data, stored

    async def _store_block(self, ob: _Open, idx: int, data: bytes, checksum: int) -> bool:
        """Write block ``idx`` and record it, if the disk has room (see :class:`DiskSpace`); whether it did."""
        if self._closing or ob.stale:
            return False

        def write() -> bool:
            if not self._hold(ob):
                return False  # evicted meanwhile: its next reader opens the new file
            try:
                ob.stored.write_block(idx, data)
                try:
                    self.index.put_block(ob.stored.key, idx, checksum, len(data), ob.record)
                except CacheFullError:
                    ob.stored.drop_block(idx)
                    raise
            finally:
                self._unhold(ob)
            return True

        decided, stored = (False, None) if len(data) >= 256 * 1024 else self.space.try_store(len(data), write)
        if not decided:
            stored = await self.run_disk(self.space.store, len(data), write)
        if not stored:
            return False
        ob.present[idx] = (checksum, len(data))
        self.note_stored(len(data))
        return True

    async def run_disk(self, fn, *args):
        """``fn(*args)`` on the disk threads (blocking file and index work); the engine's close waits for it."""
        try:
            job = self._disk.submit(fn, *args)
        except RuntimeError:  # the interpreter is exiting (atexit flush): no new threads, do it here
            return fn(*args)
        self._disk_jobs.add(job)
        job.add_done_callback(self._disk_jobs.discard)
        return await asyncio.wrap_future(job)

    def _wait_disk(self) -> None:
        """Wait for every disk job submitted so far (also those whose awaiting task was cancelled)."""
        concurrent.futures.wait(list(self._disk_jobs))

    def _keep_unstored(self, key: tuple[bytes, int], data: bytes) -> None:
        """Keep a block the disk could not take for its readers (the kernel reads a 4 MiB block in 1 MiB
        pieces; read-ahead fetched the next ones), least recently used out past ``unstored_limit`` bytes."""
        if key in self._unstored or len(data) > self.unstored_limit:
            return
        self._unstored[key] = data
        self._unstored_bytes += len(data)
        while self._unstored_bytes > self.unstored_limit:
            _, old = self._unstored.popitem(last=False)
            self._unstored_bytes -= len(old)

    def _take_unstored(self, okey: bytes, blocks: list[int]) -> dict[int, bytes]:
        """The blocks of ``blocks`` kept in memory (see :meth:`_keep_unstored`)."""
        if not self._unstored:
            return {}
        got = {}
        for i in blocks:
            data = self._unstored.get((okey, i))
            if data is not None:
                self._unstored.move_to_end((okey, i))
                got[i] = data
        return got

    @staticmethod
    def _take_ahead(ob: _Open, start: int, end: int) -> int:
        """Bytes of ``[start, end)`` in blocks read-ahead brought and no reader was served yet: misses (the
        origin was read for this reader, only earlier), and from now on ordinary cached blocks."""
        bs, n = ob.record.block_size or 1, 0
        for i in range(start // bs, (end - 1) // bs + 1):
            if i in ob.ahead:
                ob.ahead.discard(i)
                n += min(end, (i + 1) * bs) - max(start, i * bs)
        return n

    def note_stored(self, nbytes: int) -> None:
        """Count bytes newly on disk; check the limits (and start eviction) every so often. Event loop only."""
        self.space.clear()
        self._stored_since_check += nbytes
        if self._stored_since_check >= self._check_every:
            self._stored_since_check = 0
            self._maybe_evict()

    @staticmethod
    def object_key(ds: Dataset, entry: Entry) -> bytes:
        return object_key(ds.ref.id, entry.path, entry.version)

    async def ensure_cached(self, ds: Dataset, entry: Entry, on_bytes=None) -> None:
        """Make every block of ``entry`` present (prefetch). Raises CacheFullError. ``on_bytes(n)`` is called
        as each piece lands (progress while a large file is on the wire). Warming is not a read: it counts
        neither hits nor misses (a job that reads the warmed data later gets hits)."""
        self._start_background()
        if self.small.packable(entry):
            await self.small.fetch(ds, self.object_key(ds, entry), entry)
            if self.small.full_error is not None:
                raise self.small.full_error
            return
        ob = self._acquire(ds, entry)
        try:
            missing = [i for i in range(ob.nblocks) if not self._has(ob, i)]

            async def block(i: int) -> bytes | None:
                got = await self._block(ds, entry, ob, i, strict=True)
                if on_bytes is not None:
                    on_bytes(min(self.block_size, entry.size - i * self.block_size))
                return got

            await asyncio.gather(*(block(i) for i in missing))
        finally:
            self._release(ob)

    async def persist(self) -> None:
        """Write pending packs now and get back under the cache's limits (the end of a prefetch). Raises
        CacheFullError if small files could not be stored."""
        await self.small.flush()
        if self.small.full_error is not None:
            raise self.small.full_error
        if self.over_limits():
            await self.evict()

    def cached_bytes(self, ds: Dataset, entry: Entry) -> int:
        okey = self.object_key(ds, entry)
        if self.small.packable(entry):
            return entry.size if entry.size == 0 or self.small.has(okey) else 0
        with self._open_lock:
            ob = self._open.get(okey)
            if ob is not None:
                return sum(length for _, length in ob.present.values())
        rec = self.index.object(okey)
        return rec.cached_bytes if rec else 0

    # -- statistics ---------------------------------------------------------------------------------------
    def _count(self, ob: _Open, ds_id: str, stream: ReadStream | None, hit: int = 0, miss: int = 0) -> None:
        access = stream is None or not stream.counted
        if access:
            ob.hits += 1
            ob.last_access = time.time()
            if stream is not None:
                stream.counted = True
        self._count_bytes(ds_id, ob.record.path if access else None, hit, miss)

    def _count_small(self, ds: Dataset, entry: Entry, stream: ReadStream | None, hit: int = 0, miss: int = 0) -> None:
        access = stream is None or not stream.counted
        if stream is not None:
            stream.counted = True
        self._count_bytes(ds.ref.id, entry.path if access else None, hit, miss)

    def _count_bytes(self, ds_id: str, accessed_path: str | None, hit: int, miss: int) -> None:
        """Hit/miss bytes of a dataset, and one access of ``accessed_path``'s directory (hot directories)."""
        with self._stats_lock:
            s = self._ds_stats.setdefault(ds_id, [0, 0])
            s[0] += hit
            s[1] += miss
            if accessed_path is not None:
                key = (ds_id, accessed_path.rpartition("/")[0])
                self._dir_hits[key] = self._dir_hits.get(key, 0) + 1

    def _note_access(self, okey: bytes, ob: _Open) -> None:
        if ob.hits:
            with self._stats_lock:
                last, hits = self._obj_stats.get(okey, (0.0, 0))
                self._obj_stats[okey] = (max(last, ob.last_access), hits + ob.hits)
            ob.hits = 0

    def flush_stats(self) -> None:
        """Write batched access statistics (LRU times, hit/miss bytes) to the index."""
        with self._open_lock:
            for okey, ob in list(self._open.items()):
                self._note_access(okey, ob)
        with self._stats_lock:
            objs, self._obj_stats = self._obj_stats, {}
            ds = {k: (v[0], v[1]) for k, v in self._ds_stats.items() if v[0] or v[1]}
            self._ds_stats = {}
            dirs, self._dir_hits = self._dir_hits, {}
        packs = self.small.take_pack_access()
        self.small.close_unlinked()
        self.close_evicted()
        try:
            self.index.record_access(objs, ds, packs, dirs, half_life=self.config.engine.hot_dir_half_life)
        except CacheFullError as exc:  # these figures are dropped; the next flush tries again
            log.warning("access statistics not recorded: %s", exc)
        except CacheFSError as exc:
            log.error("access statistics not recorded: %s", exc)
        try:
            total, free = self.store.disk_usage()
            self.index.keep_reserve(total, free - self.min_free)
        except OSError as exc:
            log.debug("index reserve: %s", exc)

    async def start_background(self) -> None:
        """Start the periodic statistics flush now. It otherwise starts with the first read that reaches the
        event loop, which a process serving only local reads (a FUSE daemon on a warm cache) never makes; its
        hits and hot directories would reach the index only when it closes."""
        self._start_background()

    def _start_background(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.ensure_future(self._stats_loop())

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.engine.stats_flush_interval)
            await asyncio.to_thread(self.flush_stats)

    async def aclose(self) -> None:
        """Stop fetching, let every write finish, write pending packs, release the origin connections, then
        :meth:`close` the files. In that order: a file is never closed under a write still running."""
        self._closing = True
        fetches = [*self._background, *self._inflight.values()]
        for task in fetches:
            task.cancel()
        await asyncio.gather(*fetches, return_exceptions=True)
        await self.small.flush()
        for task in (self._stats_task, self._evicting):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        # Block writes the cancelled fetches started (awaited through their futures: no thread needed, which
        # matters at interpreter exit, when no new thread may start).
        await asyncio.gather(*(asyncio.wrap_future(j) for j in list(self._disk_jobs)), return_exceptions=True)
        sources, self._sources = list(self._sources.values()), {}
        for src in sources:
            await src.close()
        self.close()

    def close(self) -> None:
        """Write pending packs, flush statistics and close every open object file (call :meth:`aclose` from
        the event loop instead while fetches may be running). The engine stays usable: files open again."""
        self._wait_disk()
        self.small.flush_sync()
        self.flush_stats()
        with self._open_lock:
            for ob in self._open.values():
                ob.stored.close()
            self._open.clear()

    # -- eviction -----------------------------------------------------------------------------------------
    def over_limits(self) -> bool:
        total, _ = self.index.totals()
        _, free = self.store.disk_usage()
        return total > self.capacity * self.config.cache.high_watermark or free < self.min_free

    def _maybe_evict(self) -> None:
        if (self._evicting is None or self._evicting.done()) and self.over_limits():
            self._evicting = asyncio.ensure_future(self.evict())

    async def evict(self, *, force: bool = False) -> int:
        """Evict objects in :func:`eviction_order` until under the low watermark; returns bytes freed."""
        if force:
            return await self.run_disk(self.space.evict)
        return await self.run_disk(self.evict_sync)

    def evict_sync(self, *, force: bool = False, dataset: str | None = None, everything: bool = False,
                   need: int = 0) -> int:
        """Evict (``force``: even under the high watermark) until usage is under the low watermark and ``need``
        more bytes fit (see :class:`DiskSpace`); ``dataset``/``everything``: all of it that no reader holds."""
        self.flush_stats()
        target = min(int(self.capacity * self.config.cache.low_watermark), self.capacity - need)
        floor = max(self.min_free * 1.1, self.min_free + need)
        total, _ = self.index.totals()
        _, free = self.store.disk_usage()
        if not (force or everything or dataset) and total <= self.capacity * self.config.cache.high_watermark \
                and free >= self.min_free:
            return 0
        candidates = sorted([*self.index.objects(dataset), *((None, p) for p in self.index.packs(dataset))],
                            key=lambda kv: eviction_order(kv[1]))
        freed = 0
        keep = None if (everything or dataset) else self.prefetching_since
        for okey, rec in candidates:
            if keep is not None and rec.last_access >= keep:
                continue
            if not (everything or dataset):
                total, _ = self.index.totals()
                _, free = self.store.disk_usage()
                if total <= target and free >= floor:
                    break
            try:
                freed += self._evict_one(okey, rec)
            except CacheFullError as exc:  # not even the index's reserve let it commit
                log.error("eviction stopped: %s", exc)
                break
        if freed:
            log.info("evicted %d bytes", freed)
            self.space.clear()
        return freed

    def _evict_one(self, okey: bytes | None, rec: ObjectRecord | PackRecord) -> int:
        """Evict one object (or pack, ``okey`` None) unless a reader holds it; returns bytes freed."""
        if okey is None:  # a pack: no locks, readers that still have it open keep reading their bytes
            return self.small.remove_pack(rec)
        with self._open_lock:
            ob = self._open.get(okey)
            if ob is not None:
                if ob.holds > 0:
                    return 0  # pinned by a reader here (the exclusive lock would fail anyway)
                if ob.refs == 0:
                    self._close_open(okey, ob)
                # else: a read is under way; it reads on from the unlinked file and drops the handle after
        removed: list[int] = []

        def forget() -> bool:
            removed.append(self.index.remove_object(okey))
            return True

        return sum(removed) if self.store.try_remove(okey, rec.dataset, forget) else 0


def _keep_member(stream: ReadStream | None, okey: bytes, whole: bytes, start: int, end: int) -> None:
    """Keep a packed file's bytes on ``stream`` when this read took only part of them (more pieces follow)."""
    if stream is not None and end - start < len(whole):
        stream.member = (okey, whole)


def eviction_order(rec: ObjectRecord | PackRecord) -> tuple[bool, float]:
    """Sort key of eviction victims ("two-touch LRU"): objects read at most once go first, oldest first, then
    objects read twice or more, oldest first. One-off scans and a dataset streamed once therefore cannot push
    out data that jobs keep coming back to; bench/eviction_bench.py measures it against LRU, FIFO and
    random (better than each on skewed and hot-plus-scan traces, close to random on pure epoch scans)."""
    return rec.hits >= 2, rec.last_access


def _retrieve(task: asyncio.Future) -> None:
    """Mark a background task's outcome as seen; its awaiters (if any) get the exception themselves."""
    if not task.cancelled():
        task.exception()


_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def get_engine(config: Config) -> Engine:
    """The process's engine for ``config.cache.dir`` (one per cache dir, so single-flight spans every user)."""
    import os

    key = os.path.realpath(config.cache.dir)
    with _engines_lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _engines[key] = Engine(config)
        return eng

"""Cold fetches of small files from a dataset's packed mirror (:mod:`cachefs.mirror`).

The mirror's packs are in this node's own pack format, so a pack fetched from it is *installed as it is*:
its bytes go to a temp file at the offsets they have in the mirror, and once the whole file is here it is
published (fsync, rename) and the index points the members at it, under the offsets the mirror's index
gives. Nothing is re-serialised, and a member costs a checksum and a dictionary entry, not a copy into a new
pack (which was a third of the daemon's CPU on a cold read through the mirror).

A miss fetches the window (about :data:`MIRROR_WINDOW` bytes, see :meth:`MirrorIndex.bounds`) that holds the
file first, so its reader waits for one ranged GET; the other windows of that pack follow, and so does the
next pack (readers and prefetch move through a mirror in pack order). Until its pack is published, a member
is read from the temp file, so each byte is held in memory only while its window is on the wire and being
written.

A pack whose temp file cannot be written (the disk is full and eviction frees nothing) is given up: the files
already served stay served, and later misses on it are fetched again.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._aio import single_flight
from .checksum import block_checksum
from .errors import CacheFSError, CacheFullError
from .mirror import MirrorIndex, load_mirror

if TYPE_CHECKING:
    from .engine import Dataset
    from .small_objects import SmallObjects

__all__ = ["MIRROR_WINDOW", "MirrorFetcher"]

log = logging.getLogger(__name__)

#: The ranged GETs a mirror pack is fetched in; a miss waits for the one that holds its file.
MIRROR_WINDOW = 8 * 1024 * 1024


@dataclass(eq=False)
class _Assembly:
    """One mirror pack being written to this node."""

    ds_id: str
    pack: int
    pack_id: int
    tmp: str
    fd: int
    size: int
    windows: int
    done: set[int] = field(default_factory=set)
    #: (object key, offset, length, checksum) of the members the index will learn
    members: list[tuple[bytes, int, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # fd is read from FUSE threads


class MirrorFetcher:
    def __init__(self, small: SmallObjects) -> None:
        self.small = small
        self.engine = small.engine
        self._mirrors: dict[str, MirrorIndex | None] = {}  # dataset id → its packed mirror (None: has none)
        self._locks: dict[str, asyncio.Lock] = {}
        self._windows: dict[tuple[str, int, int], asyncio.Future] = {}
        self._assembling: dict[tuple[str, int], _Assembly] = {}
        self._members: dict[bytes, tuple[_Assembly, int, int, int]] = {}  # okey → (assembly, offset, len, ck)
        self._installs: set[asyncio.Future] = set()
        #: Files fetched from a mirror, and the GETs that brought them.
        self.files = self.gets = 0

    # -- which mirror ----------------------------------------------------------------------------------------
    async def mirror(self, ds: Dataset) -> MirrorIndex | None:
        ds_id = ds.ref.id
        if ds_id not in self._mirrors:
            async with self._locks.setdefault(ds_id, asyncio.Lock()):
                if ds_id not in self._mirrors:
                    try:
                        self._mirrors[ds_id] = await load_mirror(self.engine, ds)
                    except (CacheFSError, ValueError, KeyError) as exc:
                        log.warning("%s: cannot use its packed mirror (%s); reading files one by one", ds.ref.url, exc)
                        self._mirrors[ds_id] = None
                    if self._mirrors[ds_id] is not None:
                        log.info("%s: using its packed mirror %s", ds.ref.url, self._mirrors[ds_id].url)
        return self._mirrors[ds_id]

    # -- members of packs not yet published (any thread) -----------------------------------------------------
    def holds(self, okey: bytes) -> bool:
        return okey in self._members

    def pending(self, okey: bytes) -> tuple[_Assembly, int, int, int] | None:
        """(pack being written, offset, length, checksum) of ``okey`` if its bytes are in a pack that is not
        published yet; read it under ``assembly.lock`` from ``assembly.fd`` (-1 once the index has it)."""
        return self._members.get(okey)

    # -- fetching (event loop) -------------------------------------------------------------------------------
    async def fetch(self, ds: Dataset, mirror: MirrorIndex, okey: bytes) -> bytes:
        """``okey``'s bytes from the mirror: its window first, then the rest of its pack and the next pack."""
        pack, offset, length, _ck = mirror.entries[okey]
        fut = self._window(ds, mirror, pack, _window_of(mirror.bounds(pack, MIRROR_WINDOW), offset))
        for p in (pack, pack + 1):
            if p >= len(mirror.packs):
                break
            first = mirror.layout[p][:1]
            if (ds.ref.id, p) not in self._assembling and first and self.small.has(first[0][2]):
                continue  # that pack is here
            for w in range(len(mirror.bounds(p, MIRROR_WINDOW)) - 1):
                self._window(ds, mirror, p, w)
        if fut is None:  # its window was written here, yet the file was not found there
            raise CacheFSError(f"{mirror.url}: pack {pack}: the window written here does not hold the file")
        lo, raw, valid = await asyncio.shield(fut)
        if okey not in valid:
            raise CacheFSError(f"{mirror.url}: pack {pack}: the window fetched did not hold the file")
        return bytes(memoryview(raw)[offset - lo:offset - lo + length])

    def _window(self, ds: Dataset, mirror: MirrorIndex, pack: int, window: int) -> asyncio.Future | None:
        """The (single-flight) fetch of one window of a mirror pack, resolving to (its start, its bytes, the
        object keys in it that this manifest names); None if that window is written here already."""
        key = (ds.ref.id, pack, window)
        fut = self._windows.get(key)
        if fut is None:
            assembly = self._assembling.get((ds.ref.id, pack))
            if assembly is not None and window in assembly.done:
                return None
            fut = single_flight(self._windows, key, self._fetch_window(ds, mirror, pack, window))
        return fut

    async def _fetch_window(self, ds: Dataset, mirror: MirrorIndex, pack: int, window: int
                            ) -> tuple[int, bytes, set[bytes]]:
        bounds = mirror.bounds(pack, MIRROR_WINDOW)
        lo, hi = bounds[window], bounds[window + 1]
        url, version = mirror.packs[pack]
        budget = self.engine.budget
        await budget.acquire(hi - lo)
        try:
            raw = await self.engine.origin_get(ds.source, url, version, lo, hi - lo)
            self.gets += 1
            if len(raw) != hi - lo:
                raise CacheFSError(f"{url}: {len(raw)} bytes for a window of {hi - lo}")
            view, valid, keep = memoryview(raw), set(), []
            for off, length, okey, checksum, path, file_version in mirror.window(pack, lo, hi):
                try:
                    if ds.stat(path).version != file_version:
                        continue  # changed at the source since it was packed: the manifest names another version
                except OSError:
                    continue  # not in this manifest at all
                if block_checksum(view[off - lo:off - lo + length]) != checksum:
                    raise CacheFSError(f"{url}: a member failed its checksum")
                valid.add(okey)
                if not self.small.has(okey):
                    keep.append((okey, off, length, checksum))
            self.files += len(valid)
            self.small.note_ahead(k[0] for k in keep)  # the one a reader asked for is counted as fetched anyway
            await self._write(ds, mirror, pack, window, lo, raw, keep)
        finally:
            await budget.release(hi - lo)
        return lo, raw, valid

    async def _write(self, ds: Dataset, mirror: MirrorIndex, pack: int, window: int, lo: int, raw: bytes,
                     keep: list[tuple[bytes, int, int, int]]) -> None:
        """Write one window into its pack's temp file; publish the pack once every window is in."""
        key = (ds.ref.id, pack)
        assembly = self._assembling.get(key)
        if assembly is None:
            try:
                pack_id, tmp, fd = self.small.store.begin(ds.ref.id)
            except CacheFSError as exc:
                log.warning("%s: cannot keep mirror pack %d here: %s", mirror.url, pack, exc)
                return
            assembly = self._assembling[key] = _Assembly(ds.ref.id, pack, pack_id, tmp, fd, mirror.pack_sizes[pack],
                                                         len(mirror.bounds(pack, MIRROR_WINDOW)) - 1)
        try:
            written = await self.engine.run_disk(self.engine.space.store, len(raw),
                                                 lambda: self._write_window(assembly, raw, lo))
        except CacheFSError as exc:
            self._give_up(assembly, exc)
            return
        if written is None:
            self._give_up(assembly, CacheFullError("no room on the cache disk"))
            return
        if not written:
            return  # given up meanwhile
        if self._assembling.get(key) is not assembly:
            return  # given up meanwhile
        assembly.done.add(window)
        assembly.members.extend(keep)
        for okey, off, length, checksum in keep:
            self._members[okey] = (assembly, off, length, checksum)
        if len(assembly.done) == assembly.windows:
            del self._assembling[key]
            task = asyncio.ensure_future(self.engine.run_disk(self._publish, assembly))
            self._installs.add(task)
            task.add_done_callback(self._installed_done)

    def _write_window(self, assembly: _Assembly, raw: bytes, lo: int) -> bool:
        """Write a window at its offset in the assembly's temp file (a thread); False if it was given up."""
        with assembly.lock:  # not closed under the write
            if assembly.fd < 0:
                return False
            self.small.store.write_at(assembly.fd, raw, lo, assembly.tmp)
        return True

    def _publish(self, assembly: _Assembly) -> int:
        """Publish a complete pack and record its members (a thread); returns its size (0: not kept)."""
        size = os.fstat(assembly.fd).st_size
        if size != assembly.size:
            self._give_up(assembly, CacheFSError(f"{size} bytes written of {assembly.size}"))
            return 0
        # The temp file is renamed under its descriptor; reads through it keep working until it is closed.
        dup = os.dup(assembly.fd)
        try:
            self.small.store.publish(assembly.ds_id, assembly.pack_id, assembly.tmp, dup)
            try:
                self.engine.index.commit_pack(assembly.ds_id, assembly.pack_id, size, assembly.members)
            except CacheFSError:
                self.small.store.remove(assembly.ds_id, assembly.pack_id)  # never a pack the index does not know
                raise
        finally:
            fd = self._detach(assembly)
            if fd >= 0:
                os.close(fd)
        return size

    def _installed_done(self, task: asyncio.Future) -> None:
        self._installs.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("installing a mirror pack failed: %s", task.exception())
        elif task.result():
            self.small.full_error = None
            self.engine.note_stored(task.result())

    def _give_up(self, assembly: _Assembly, exc: BaseException) -> None:
        log.warning("mirror pack %d: not kept on this node (%s)", assembly.pack, exc)
        if isinstance(exc, CacheFullError):
            self.small.full_error = CacheFullError(f"cache disk full: could not keep a mirror pack of "
                                                   f"{assembly.size} B (capacity {self.engine.capacity} B)")
        self._assembling.pop((assembly.ds_id, assembly.pack), None)
        fd = self._detach(assembly)
        if fd >= 0:
            self.small.store.abandon(assembly.tmp, fd)

    def _detach(self, assembly: _Assembly) -> int:
        """Serve the assembly's members from the index (or not at all) from now on; returns its temp file's
        descriptor for the caller to close (-1 if that was done already)."""
        for okey, *_rest in assembly.members:
            got = self._members.get(okey)
            if got is not None and got[0] is assembly:
                del self._members[okey]
        with assembly.lock:
            fd, assembly.fd = assembly.fd, -1
        return fd

    async def flush(self) -> None:
        """Wait for the windows on the wire and the publication of every pack they complete."""
        while self._windows or self._installs:
            await asyncio.gather(*self._windows.values(), *self._installs, return_exceptions=True)

    def close(self) -> None:
        """Drop the packs still being assembled (their temp files go; the files will be fetched again)."""
        for assembly in list(self._assembling.values()):
            self._give_up(assembly, CacheFSError("shutting down"))


def _window_of(bounds: list[int], offset: int) -> int:
    return bisect.bisect_right(bounds, offset) - 1

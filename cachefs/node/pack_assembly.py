"""Packs written to this node window by window: a pack of a packed mirror arrives as ranged GETs of about 8 MiB,
each written at its offset into the pack's temp file, and once every window is in, the pack is published (fsync,
rename) and the index points its members at it, under the offsets the mirror's index gives. Nothing is
re-serialised.

Until then its members are readable from the temp file (:meth:`PackAssemblies.pending`), so each byte is held in
memory only while its window is on the wire and being written. A pack whose temp file cannot be written (no room,
see :meth:`~cachefs.node.eviction.Evictor.store`) is given up: what was served stays served, later misses fetch again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field

from cachefs.base.errors import CacheFSError, CacheFullError
from cachefs.index import Index
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.eviction import Evictor
from cachefs.store.packs import PackStore

__all__ = ["Assembly", "PackAssemblies"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Assembly:
    """One pack being written here."""

    ds_id: str
    pack: int  # its number in the mirror
    pack_id: int  # its id here
    tmp: str
    fd: int
    size: int
    windows: int
    done: set[int] = field(default_factory=set)
    #: (object key, offset, length, checksum) of the members the index will learn
    members: list[tuple[bytes, int, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # fd is read from FUSE threads


class PackAssemblies:
    def __init__(self, store: PackStore, index: Index, evictor: Evictor, disk: DiskJobs) -> None:
        self.store, self.index, self.evictor, self.disk = store, index, evictor, disk
        self._assembling: dict[tuple[str, int], Assembly] = {}
        self._members: dict[bytes, tuple[Assembly, int, int, int]] = {}  # okey → (assembly, offset, len, checksum)
        self._installs: set[asyncio.Future] = set()
        #: Set while packs cannot be kept for lack of space (cleared by the next one that is).
        self.full_error: CacheFullError | None = None

    # -- members not yet published (any thread) -------------------------------------------------------------
    def holds(self, okey: bytes) -> bool:
        return okey in self._members

    def pending(self, okey: bytes) -> tuple[Assembly, int, int, int] | None:
        """(pack being written, offset, length, checksum) of ``okey`` if its bytes are in a pack that is not
        published yet; read it under ``assembly.lock`` from ``assembly.fd`` (-1 once the index has it)."""
        return self._members.get(okey)

    # -- writing (event loop) -------------------------------------------------------------------------------
    def window_done(self, ds_id: str, pack: int, window: int) -> bool:
        a = self._assembling.get((ds_id, pack))
        return a is not None and window in a.done

    def assembling(self, ds_id: str, pack: int) -> bool:
        return (ds_id, pack) in self._assembling

    async def write(self, ds_id: str, pack: int, size: int, windows: int, window: int, lo: int, raw: bytes,
                    members: list[tuple[bytes, int, int, int]]) -> None:
        """Write window ``window`` (bytes ``raw`` at ``lo``) of ``pack`` (``size`` bytes in ``windows`` windows),
        whose ``members`` (object key, offset, length, checksum) are wanted here; publish the pack once every
        window is in."""
        key = (ds_id, pack)
        assembly = self._assembling.get(key)
        if assembly is None:
            try:
                pack_id, tmp, fd = self.store.begin(ds_id)
            except CacheFSError as exc:
                log.warning("pack %d: cannot keep it here: %s", pack, exc)
                return
            assembly = self._assembling[key] = Assembly(ds_id, pack, pack_id, tmp, fd, size, windows)
        try:
            written = await self.disk.run(self.evictor.store, len(raw), lambda: self._write_window(assembly, raw, lo))
        except CacheFSError as exc:
            self._give_up(assembly, exc)
            return
        if written is None:
            self._give_up(assembly, CacheFullError("no room on the cache disk"))
            return
        if not written or self._assembling.get(key) is not assembly:
            return  # given up meanwhile
        assembly.done.add(window)
        assembly.members.extend(members)
        for okey, off, length, checksum in members:
            self._members[okey] = (assembly, off, length, checksum)
        if len(assembly.done) == assembly.windows:
            del self._assembling[key]
            task = asyncio.ensure_future(self.disk.run(self._publish, assembly))
            self._installs.add(task)
            task.add_done_callback(self._installed)

    def _write_window(self, assembly: Assembly, raw: bytes, lo: int) -> bool:
        """Write a window at its offset in the temp file (a disk thread); False if it was given up."""
        with assembly.lock:  # not closed under the write
            if assembly.fd < 0:
                return False
            self.store.write_at(assembly.fd, raw, lo, assembly.tmp)
        return True

    def _publish(self, assembly: Assembly) -> int:
        """Publish a complete pack and record its members (a disk thread); its size (0: not kept)."""
        size = os.fstat(assembly.fd).st_size
        if size != assembly.size:
            self._give_up(assembly, CacheFSError(f"{size} bytes written of {assembly.size}"))
            return 0
        # The temp file is renamed under its descriptor; reads through it keep working until it is closed.
        dup = os.dup(assembly.fd)
        try:
            self.store.publish(assembly.ds_id, assembly.pack_id, assembly.tmp, dup)
            try:
                self.index.commit_pack(assembly.ds_id, assembly.pack_id, size, assembly.members)
            except CacheFSError:
                self.store.remove(assembly.ds_id, assembly.pack_id)  # never a pack the index does not know
                raise
        finally:
            fd = self._detach(assembly)
            if fd >= 0:
                os.close(fd)
        return size

    def _installed(self, task: asyncio.Future) -> None:
        self._installs.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("installing a pack failed: %s", task.exception())
        elif task.result():
            self.full_error = None
            self.evictor.note_stored(task.result())

    def _give_up(self, assembly: Assembly, exc: BaseException) -> None:
        log.warning("pack %d: not kept on this node (%s)", assembly.pack, exc)
        if isinstance(exc, CacheFullError):
            self.full_error = CacheFullError(f"cache disk full: could not keep a pack of {assembly.size} B "
                                             f"(capacity {self.evictor.capacity} B)")
        self._assembling.pop((assembly.ds_id, assembly.pack), None)
        fd = self._detach(assembly)
        if fd >= 0:
            self.store.abandon(assembly.tmp, fd)

    def _detach(self, assembly: Assembly) -> int:
        """Serve the assembly's members from the index (or not at all) from now on; returns its temp file's
        descriptor for the caller to close (-1 if that was done already)."""
        for okey, *_rest in assembly.members:
            got = self._members.get(okey)
            if got is not None and got[0] is assembly:
                del self._members[okey]
        with assembly.lock:
            fd, assembly.fd = assembly.fd, -1
        return fd

    async def drain(self) -> None:
        """Wait for the packs being published."""
        while self._installs:
            await asyncio.gather(*self._installs, return_exceptions=True)

    def close(self) -> None:
        """Drop the packs still being assembled (their temp files go; the files will be fetched again)."""
        for assembly in list(self._assembling.values()):
            self._give_up(assembly, CacheFSError("shutting down"))

"""Packs written to this node window by window: a pack of a packed mirror arrives as ranged GETs of about 8 MiB
(:class:`~cachefs.formats.mirror_index.MirrorWindow`), each written at its offset into the pack's temp file, and
once every window is in, the pack is published (fsync, rename) and the index points its members at it, under the
offsets the mirror's index gives. Nothing is re-serialised.

A window's members are readable the moment it is accepted (:meth:`PackAssemblies.read`): from the window's bytes
in memory until they are written, then from the temp file, then from the published pack. At most
:data:`MAX_UNWRITTEN` bytes of accepted windows wait for the disk (:meth:`PackAssemblies.backlog`). A pack whose
temp file cannot be written (no room, see :meth:`~cachefs.node.admission.Admission.store`) is given up: what was
served stays served, later misses fetch again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Literal

from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CacheFSError, CacheFullError
from cachefs.formats.mirror_index import MirrorWindow
from cachefs.formats.pack_file import CORRUPT, MemberRead, read_member
from cachefs.index import Index
from cachefs.node.admission import Admission
from cachefs.node.disk_jobs import DiskJobs
from cachefs.store.base import PackStore

__all__ = ["MAX_UNWRITTEN", "Assembly", "PackAssemblies"]

log = logging.getLogger(__name__)

#: Bytes of accepted windows that may wait for the disk before those who accept more wait too.
MAX_UNWRITTEN = 32 * 1024 * 1024


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
    #: Windows accepted and not written yet: window → (its start in the pack, its bytes).
    unwritten: dict[int, tuple[int, bytes | bytearray]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # fd and unwritten are read from FUSE threads


class PackAssemblies:
    def __init__(self, store: PackStore, index: Index, admission: Admission, disk: DiskJobs) -> None:
        self.store, self.index, self.admission, self.disk = store, index, admission, disk
        self._assembling: dict[tuple[str, int], Assembly] = {}
        self._members: dict[bytes, tuple[Assembly, int, int, int]] = {}  # okey → (assembly, offset, len, checksum)
        self._installs: set[asyncio.Future] = set()
        self._unwritten = 0
        #: Set while packs cannot be kept for lack of space (cleared by the next one that is).
        self.full_error: CacheFullError | None = None

    # -- members not yet published (any thread) -------------------------------------------------------------
    def holds(self, okey: bytes) -> bool:
        return okey in self._members

    def read(self, okey: bytes, wait: bool = True
             ) -> bytes | bytearray | Literal[MemberRead.WOULD_WAIT] | None:
        """``okey``'s bytes if it is in a pack being assembled here, verified; None if it is not (or no longer: then
        the index has it). Without ``wait``, WOULD_WAIT if reading it would wait on the disk."""
        got = self._members.get(okey)
        if got is None:
            return None
        assembly, offset, length, checksum = got
        with assembly.lock:
            for start, data in assembly.unwritten.values():
                if start <= offset < start + len(data):
                    member = data[offset - start:offset - start + length]
                    return member if block_checksum(member) == checksum else None
            if assembly.fd < 0:
                return None
            member_read = read_member(assembly.fd, offset, length, checksum, wait)
        return None if member_read is CORRUPT else member_read

    # -- writing (event loop) -------------------------------------------------------------------------------
    def accepted(self, ds_id: str, pack: int, window: int) -> bool:
        """Whether that window is here: accepted (written or not) into a pack being assembled."""
        a = self._assembling.get((ds_id, pack))
        return a is not None and (window in a.done or window in a.unwritten)

    def assembling(self, ds_id: str, pack: int) -> bool:
        return (ds_id, pack) in self._assembling

    @property
    def unwritten_bytes(self) -> int:
        return self._unwritten

    def accept(self, window: MirrorWindow, members: list[tuple[bytes, int, int, int]]) -> bool:
        """Take ``window`` into its pack, with the ``members`` (object key, offset, length, checksum) wanted here:
        readable at once, written in the background; the pack is published once every window is in. False if it
        was not taken: accepted already, or its pack cannot be kept here."""
        key = (window.ds_id, window.pack)
        assembly = self._assembling.get(key)
        if assembly is None:
            try:
                pack_id, tmp, fd = self.store.begin(window.ds_id)
            except CacheFSError as exc:
                log.warning("pack %d: cannot keep it here: %s", window.pack, exc)
                return False
            assembly = self._assembling[key] = Assembly(window.ds_id, window.pack, pack_id, tmp, fd,
                                                        window.pack_size, window.windows)
        if window.window in assembly.done or window.window in assembly.unwritten:
            return False
        with assembly.lock:
            assembly.unwritten[window.window] = (window.start, window.data)
        self._unwritten += len(window.data)
        assembly.members.extend(members)
        for okey, off, length, checksum in members:
            self._members[okey] = (assembly, off, length, checksum)
        task = asyncio.ensure_future(self._write(assembly, window.window, window.start, window.data))
        self._installs.add(task)
        task.add_done_callback(self._installs.discard)
        return True

    async def backlog(self) -> None:
        """Wait while more than :data:`MAX_UNWRITTEN` bytes of accepted windows wait for the disk."""
        while self._unwritten > MAX_UNWRITTEN and self._installs:
            await asyncio.wait(list(self._installs), return_when=asyncio.FIRST_COMPLETED)

    async def _write(self, assembly: Assembly, window: int, lo: int, raw: bytes | bytearray) -> None:
        try:
            written = await self.disk.run(self.admission.store, len(raw), lambda: self._write_window(assembly, raw, lo),
                                          assembly.ds_id)
        except CacheFSError as exc:
            self._give_up(assembly, exc)
            return
        finally:
            self._unwritten -= len(raw)
        if written is None:
            self._give_up(assembly, CacheFullError("no room on the cache disk"))
            return
        key = (assembly.ds_id, assembly.pack)
        with assembly.lock:
            assembly.unwritten.pop(window, None)
        if not written or self._assembling.get(key) is not assembly:
            return  # given up meanwhile
        assembly.done.add(window)
        if len(assembly.done) == assembly.windows:
            del self._assembling[key]
            task = asyncio.ensure_future(self.disk.run(self._publish, assembly))
            self._installs.add(task)
            task.add_done_callback(self._installed)

    def _write_window(self, assembly: Assembly, raw: bytes | bytearray, lo: int) -> bool:
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
            self.admission.note_stored(task.result())

    def _give_up(self, assembly: Assembly, exc: BaseException) -> None:
        log.warning("pack %d: not kept on this node (%s)", assembly.pack, exc)
        if isinstance(exc, CacheFullError):
            self.full_error = CacheFullError(f"cache disk full: could not keep a pack of {assembly.size} B "
                                             f"(capacity {self.admission.capacity} B)")
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
            assembly.unwritten.clear()
        return fd

    async def drain(self) -> None:
        """Wait for the windows being written and the packs being published."""
        while self._installs:
            await asyncio.gather(*self._installs, return_exceptions=True)

    def close(self) -> None:
        """Drop the packs still being assembled (their temp files go; the files will be fetched again)."""
        for assembly in list(self._assembling.values()):
            self._give_up(assembly, CacheFSError("shutting down"))

"""Pack files on this node's disk: many small objects of one dataset in one Arrow IPC file (the format:
:mod:`cachefs.formats.pack_file`).

A million 100 KiB files as a million local files costs a million inodes, opens and unlinks; packed, they are a
few hundred files of tens of MiB, each written once, read with ``pread`` at an offset the index records, and
evicted (and later shipped between nodes) as a unit.

Layout (docs/FORMAT.md): ``packs/<dataset id>/<pack id as 16 hex digits>.arrow``, an Arrow IPC *file* (readable
by ``pyarrow.ipc.open_file``) with one record batch of columns ``path`` (utf8), ``version`` (utf8),
``checksum`` (uint64, xxh3-64 of the member) and ``data`` (binary). The index maps each member's object key to
(pack id, offset of its bytes in the file, length, checksum), so reads need neither pyarrow nor a parse.

Crash safety: a pack is written to ``<name>.<pid>.tmp``, fsynced, then renamed; the index learns its members
only after that. A half-written pack is therefore never named by the index, and leftovers are removed at
start (temp files of dead writers; complete packs the index never learnt of, after a grace period).

Eviction unlinks a pack without waiting for readers: a process that still has it open keeps reading the same
(checksummed) bytes until it notices the file is gone (``st_nlink == 0``) and closes it, which frees the space.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Callable, Iterable

from cachefs.base.errors import CacheFSError, CacheFullError
from cachefs.formats.pack_file import Member, serialize
from cachefs.store.base import PackStore, WrittenPack

__all__ = ["ORPHAN_GRACE", "DiskPackStore"]

_NAME = re.compile(r"^([0-9a-f]{16})\.arrow$")
_TMP = re.compile(r"^[0-9a-f]{16}\.arrow\.(\d+)\.tmp$")
#: A complete pack file the index does not know is an orphan once it is older than this (its writer crashed
#: between the rename and the index commit, which are milliseconds apart).
ORPHAN_GRACE = 300.0


class DiskPackStore(PackStore):
    def __init__(self, cache_dir: str) -> None:
        self.root = os.path.join(cache_dir, "packs")
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def pack_path(self, dataset: str, pack_id: int) -> str:
        return os.path.join(self.root, dataset, f"{pack_id:016x}.arrow")

    def write(self, dataset: str, members: list[Member]) -> WrittenPack:
        """Write ``members`` as one new pack (crash-safely) and return where each member's bytes are."""
        view, placed = serialize(members)
        pack_id, tmp, fd = self.begin(dataset)
        try:
            self.write_at(fd, view, 0, tmp)
        except CacheFSError:
            self.abandon(tmp, fd)
            raise
        self.publish(dataset, pack_id, tmp, fd)
        return WrittenPack(pack_id, len(view), placed)

    def begin(self, dataset: str) -> tuple[int, str, int]:
        """A new pack's id, and its temp file (path, writable descriptor): fill it, then :meth:`publish` it
        (or :meth:`abandon` it). The temp file of a writer that died is removed by :meth:`clean`."""
        pack_id = int.from_bytes(os.urandom(8), "big")
        path = self.pack_path(dataset, pack_id)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _write_error(exc, "a new pack", tmp) from None
        return pack_id, tmp, fd

    def write_at(self, fd: int, data: bytes | bytearray | memoryview, offset: int, tmp: str) -> None:
        """Write all of ``data`` at ``offset`` of the temp file ``tmp`` (open as ``fd``); CacheFullError when
        the disk is full, CacheFSError for any other failure."""
        view, done = memoryview(data), 0
        try:
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            raise _write_error(exc, "a pack", tmp) from None

    def publish(self, dataset: str, pack_id: int, tmp: str, fd: int) -> None:
        """Make a filled temp file the pack ``pack_id``: fsync, rename, fsync the directory; closes ``fd``.
        Only after this may the index name the pack."""
        path = self.pack_path(dataset, pack_id)
        try:
            os.fsync(fd)
            os.rename(tmp, path)
            dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            self.abandon(tmp, fd)
            raise _write_error(exc, "a pack", path) from None
        os.close(fd)

    def abandon(self, tmp: str, fd: int) -> None:
        """Drop an unpublished temp file (closes ``fd``)."""
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass

    def open(self, dataset: str, pack_id: int) -> int | None:
        """A read-only descriptor of the pack, or None if it is gone (evicted)."""
        try:
            fd = os.open(self.pack_path(dataset, pack_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        # Members are read whole, one pread each, in the readers' order: the device's read-ahead (8 MiB here)
        # would pull megabytes of other members into the page cache for every cold 30 KiB read.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def remove(self, dataset: str, pack_id: int) -> None:
        try:
            os.unlink(self.pack_path(dataset, pack_id))
        except FileNotFoundError:
            pass

    def files(self) -> Iterable[tuple[str, int, str]]:
        """(dataset, pack id, path) of every complete pack file on disk."""
        for dataset in _listdir(self.root):
            d = os.path.join(self.root, dataset)
            for name in _listdir(d):
                m = _NAME.match(name)
                if m:
                    yield dataset, int(m.group(1), 16), os.path.join(d, name)

    def clean(self, known: Callable[[str, int], bool]) -> int:
        """Remove temp files of writers that are gone and complete packs that ``known(dataset, pack_id)`` says
        the index never learnt of (older than :data:`ORPHAN_GRACE`). Returns how many files went."""
        removed = 0
        for dataset in _listdir(self.root):
            d = os.path.join(self.root, dataset)
            for name in _listdir(d):
                m = _TMP.match(name)
                if m and not _pid_alive(int(m.group(1))):
                    removed += _unlink(os.path.join(d, name))
        now = time.time()
        for dataset, pack_id, path in list(self.files()):
            if known(dataset, pack_id):
                continue
            try:
                old = now - os.stat(path).st_mtime > ORPHAN_GRACE
            except FileNotFoundError:
                continue
            if old:
                removed += _unlink(path)
        return removed


def _write_error(exc: OSError, what: str, path: str) -> CacheFSError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheFullError(f"cache disk full while writing {what}")
    return CacheFSError(f"cache disk error writing {path}: {exc.strerror}", errno_=exc.errno)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

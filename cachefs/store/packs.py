"""Pack files: many small objects of one dataset in one Arrow IPC file.

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
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate

from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CacheFSError, CacheFullError

__all__ = ["CORRUPT", "WOULD_WAIT", "Member", "PackStore", "WrittenPack", "read_member", "serialize"]

_NAME = re.compile(r"^([0-9a-f]{16})\.arrow$")
_TMP = re.compile(r"^[0-9a-f]{16}\.arrow\.(\d+)\.tmp$")
#: A complete pack file the index does not know is an orphan once it is older than this (its writer crashed
#: between the rename and the index commit, which are milliseconds apart).
ORPHAN_GRACE = 300.0


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: What a read that must not wait answers when the bytes are on this node but not in the page cache.
WOULD_WAIT = _Sentinel("WOULD_WAIT")
#: What :func:`read_member` answers for a member that failed its checksum.
CORRUPT = _Sentinel("CORRUPT")
_nowait_reads = hasattr(os, "RWF_NOWAIT")


def read_member(fd: int, offset: int, length: int, checksum: int, wait: bool = True) -> bytes | bytearray | _Sentinel:
    """A member's bytes from a pack (or a pack being written), verified against ``checksum``; CORRUPT if they
    fail it; without ``wait``, WOULD_WAIT if the page cache does not hold them all (a read would wait on the
    disk)."""
    data = os.pread(fd, length, offset) if wait else _pread_cached(fd, length, offset)
    if data is None:
        return WOULD_WAIT
    return data if len(data) == length and block_checksum(data) == checksum else CORRUPT


def _pread_cached(fd: int, length: int, offset: int) -> bytes | bytearray | None:
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


@dataclass(frozen=True, slots=True)
class Member:
    okey: bytes
    path: str
    version: str
    checksum: int
    data: bytes


@dataclass(frozen=True)
class WrittenPack:
    pack_id: int
    size: int
    #: (object key, offset of the bytes in the file, length, checksum) per member
    members: list[tuple[bytes, int, int, int]]


def _schema():
    import pyarrow as pa

    return pa.schema([("path", pa.string()), ("version", pa.string()), ("checksum", pa.uint64()),
                      ("data", pa.binary())])


class PackStore:
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

    @staticmethod
    def write_at(fd: int, data: bytes | memoryview, offset: int, tmp: str) -> None:
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


def serialize(members: list[Member]) -> tuple[memoryview, list[tuple[bytes, int, int, int]]]:
    """The bytes of a pack file holding ``members`` and, per member, (object key, offset of its bytes in
    them, length, checksum)."""
    import pyarrow as pa

    # Arrays straight from buffers: pa.array() on a list imports pandas (0.2-0.6 s a process) and copies
    # value by value.
    checksums = pa.Array.from_buffers(pa.uint64(), len(members),
                                      [None, pa.py_buffer(array("Q", [m.checksum for m in members]))])
    batch = pa.record_batch([_variable(pa.string(), [m.path.encode() for m in members]),
                             _variable(pa.string(), [m.version.encode() for m in members]),
                             checksums,
                             _variable(pa.binary(), [m.data for m in members])], schema=_schema())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    buf = sink.getvalue()
    # Reading the file back from memory gives zero-copy views into ``buf``: the data column's value buffer
    # sits at a fixed place in the file, and each member at its offset within that buffer.
    column = pa.ipc.open_file(buf).get_batch(0).column(3)
    _validity, offsets_buf, values_buf = column.buffers()
    base = values_buf.address - buf.address if values_buf is not None else 0
    offsets = memoryview(offsets_buf).cast("i")[column.offset:] if len(column) else []
    view = memoryview(buf)
    placed = []
    for i, m in enumerate(members):
        off = base + offsets[i]
        if block_checksum(view[off:off + len(m.data)]) != m.checksum:  # the layout is not what we think
            raise CacheFSError(f"pack writer: member {m.path} is not where Arrow put it")
        placed.append((m.okey, off, len(m.data), m.checksum))
    return view, placed


def _variable(type_, values: list[bytes]):
    """An Arrow utf8/binary array of ``values`` (32-bit offsets: a pack is far below 2 GiB). The values are
    copied into a buffer from Arrow's memory pool, which keeps its memory between packs: ``b"".join`` asked
    malloc for tens of MiB, which with the engine's pinned mmap threshold (cachefs/base/memory.py) was a fresh
    mapping faulted in page by page, with the GIL held (serialising a 64 MiB pack: 90 → 40 ms)."""
    import pyarrow as pa

    offsets = array("i", [0])
    offsets.extend(accumulate(map(len, values)))
    buf = pa.allocate_buffer(offsets[-1])
    out = memoryview(buf).cast("B")
    for v, at in zip(values, offsets, strict=False):  # (offsets ends with one more: the total)
        out[at:at + len(v)] = v
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(offsets), buf])


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

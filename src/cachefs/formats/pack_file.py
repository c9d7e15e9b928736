"""The pack file format: many small objects of one dataset in one Arrow IPC file (docs/FORMAT.md), and reading one
member back.

An Arrow IPC *file* (readable by ``pyarrow.ipc.open_file``) with one record batch of columns ``path`` (utf8),
``version`` (utf8), ``checksum`` (uint64, xxh3-64 of the member) and ``data`` (binary). :func:`serialize` lays the
members out and says where each member's bytes are; :func:`read_member` reads one with a single ``pread`` and
verifies it, so reads need neither pyarrow nor a parse. The node's pack store (:mod:`cachefs.store.pack_store`)
and a dataset's packed mirror (:mod:`cachefs.formats.mirror_index`) both hold packs in this format.
"""

from __future__ import annotations

import enum
import errno
import os
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, Literal

from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CacheFSError

__all__ = ["CORRUPT", "WOULD_WAIT", "Member", "MemberRead", "read_member", "serialize"]

class MemberRead(enum.Enum):
    """What :func:`read_member` answers instead of bytes."""

    #: A read that must not wait: the bytes are on this node, but not in the page cache.
    WOULD_WAIT = "would wait"
    #: The member failed its checksum.
    CORRUPT = "corrupt"


WOULD_WAIT: Final = MemberRead.WOULD_WAIT
CORRUPT: Final = MemberRead.CORRUPT
_nowait_reads = hasattr(os, "RWF_NOWAIT")


def read_member(fd: int, offset: int, length: int, checksum: int, wait: bool = True
                ) -> bytes | bytearray | Literal[MemberRead.WOULD_WAIT, MemberRead.CORRUPT]:
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


def _schema():
    import pyarrow as pa

    return pa.schema([("path", pa.string()), ("version", pa.string()), ("checksum", pa.uint64()),
                      ("data", pa.binary())])


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



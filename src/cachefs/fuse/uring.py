"""FUSE over io_uring: the kernel hands requests to per-CPU queues of buffers the daemon registered, instead of one
``/dev/fuse`` read per request (Linux 6.14+, ``CONFIG_FUSE_IO_URING``, module parameter ``fuse.enable_uring``).

What the kernel expects, from its UAPI (``include/uapi/linux/fuse.h``, protocol 7.42) and
``Documentation/filesystems/fuse-io-uring.rst``:

- INIT is answered through ``/dev/fuse`` as always; the kernel offers ``FUSE_OVER_IO_URING`` (``InitFlag.OVER_IO_URING``, bit 41)
  only when the module parameter is on, and uses the ring only if the daemon's answer keeps it.
- The daemon then registers *ring entries*: an ``IORING_OP_URING_CMD`` SQE (128-byte SQEs) on the ``/dev/fuse``
  descriptor with ``cmd_op`` REGISTER, an iovec pair {header (288 bytes), payload (at least the largest request)}
  and, in the SQE's command area, ``fuse_uring_cmd_req`` {flags, commit_id, qid}. Every possible CPU's queue needs
  at least one entry before the kernel switches to the ring; a request goes to the queue of the CPU its caller ran
  on.
- A request arrives as the completion of its entry's SQE: the header holds ``fuse_in_header`` (in_out), the
  opcode's fixed argument (op_in) and ``fuse_uring_ent_in_out`` {flags, commit_id, payload_sz}; the payload buffer
  holds the remaining arguments.
- The answer goes back in the same buffers (``fuse_out_header`` in in_out, the reply body in the payload,
  payload_sz its length) with a COMMIT_AND_FETCH SQE naming the request's commit_id, which also gives the entry back
  for the next request.
- FORGET, INTERRUPT and notifications still travel through ``/dev/fuse``.

The ring's memory is shared with the kernel: on x86-64 (total store order) plain loads and stores through the
mmap are ordered as the ring protocol needs; this module refuses other machines rather than add barriers.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import threading
from dataclasses import dataclass

from cachefs.fuse import kernel_abi as abi

__all__ = ["FuseRing", "RingEntry", "RingRequest", "possible_cpus", "uring_enabled"]

_SYS_IO_URING_SETUP = 425
_SYS_IO_URING_ENTER = 426
_IORING_SETUP_SQE128 = 1 << 10
_IORING_FEAT_SINGLE_MMAP = 1 << 0
_IORING_ENTER_GETEVENTS = 1 << 0
_IORING_OFF_SQ_RING = 0
_IORING_OFF_CQ_RING = 0x8000000
_IORING_OFF_SQES = 0x10000000
_IORING_OP_URING_CMD = 46
_SQE_SIZE = 128
_CQE = struct.Struct("<QiI")  # user_data, res, flags
#: sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd, resv[3], then the SQ ring's
#: offsets (head, tail, ring_mask, ring_entries, flags, dropped, array, resv1, user_addr) and the CQ ring's (head,
#: tail, ring_mask, ring_entries, overflow, cqes, flags, resv1, user_addr).
_PARAMS = struct.Struct("<10I" + "8IQ" + "8IQ")

FUSE_IO_URING_CMD_REGISTER = 1
FUSE_IO_URING_CMD_COMMIT_AND_FETCH = 2
_HEADER_SIZE = 128 + 128 + 32  # in_out, op_in, fuse_uring_ent_in_out
_ENT_IN_OUT = struct.Struct("<QQII8x")  # flags, commit_id, payload_sz, padding, reserved
_CMD_REQ = struct.Struct("<QQH6x")  # flags, commit_id, qid
#: opcode, flags, ioprio, fd, cmd_op, pad, addr, len, op_flags, user_data
_SQE_HEAD = struct.Struct("<BBHiIIQIIQ")
_ENABLE_PARAM = "/sys/module/fuse/parameters/enable_uring"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def uring_enabled() -> bool:
    """Whether this kernel would offer FUSE over io_uring at INIT (the module parameter is on, x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open(_ENABLE_PARAM) as f:
            return f.read().strip() in ("Y", "1")
    except OSError:
        return False


def possible_cpus() -> int:
    """The kernel keeps one FUSE queue per possible CPU (``nr_cpu_ids``): every one needs an entry."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            spans = f.read().strip().split(",")
        return max(int(s.split("-")[-1]) for s in spans) + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@dataclass(eq=False)
class RingEntry:
    """One registered pair of buffers of queue ``qid`` (the kernel fills them with a request, we with the answer)."""

    index: int
    qid: int
    header: mmap.mmap
    payload: mmap.mmap
    iov: ctypes.Array  # the two iovecs REGISTER points at (kept alive with the entry)
    commit_id: int = 0


@dataclass(frozen=True)
class RingRequest:
    """A request taken off the ring: ``size`` bytes in the classic ``/dev/fuse`` layout were copied into the
    caller's buffer; the answer goes back through ``entry``."""

    entry: RingEntry
    size: int


class FuseRing:
    """An io_uring with ``depth`` FUSE ring entries on each of ``queues`` queues of the ``/dev/fuse`` descriptor
    ``fd``. Thread-safe: any thread may answer (:meth:`commit`); one thread at a time takes requests
    (:meth:`next_request`)."""

    def __init__(self, fd: int, *, queues: int, depth: int, payload_size: int) -> None:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise OSError(errno.EOPNOTSUPP, "FUSE over io_uring is implemented for x86-64 only")
        self.fd = fd
        self.entries: list[RingEntry] = []
        self._lock = threading.Lock()  # the SQ ring (any thread commits)
        self._ready: list[tuple[int, int]] = []  # completions not yet taken: (entry index, result)
        #: Requests taken off the ring so far.
        self.taken = 0
        size = max(8, 1 << (queues * depth * 2 - 1).bit_length())
        params = bytearray(_PARAMS.size)
        _PARAMS.pack_into(params, 0, 0, 0, _IORING_SETUP_SQE128, *([0] * 7), *([0] * 9), *([0] * 9))
        pbuf = (ctypes.c_char * len(params)).from_buffer(params)
        ring_fd = _libc.syscall(_SYS_IO_URING_SETUP, size, pbuf)
        if ring_fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.ring_fd = int(ring_fd)
        try:
            self._map(_PARAMS.unpack_from(params))
            for qid in range(queues):
                for _ in range(depth):
                    self._register(qid, payload_size)
            self.submit()
        except BaseException:
            self.close()
            raise

    def _map(self, p: tuple[int, ...]) -> None:
        sq_entries, cq_entries, features = p[0], p[1], p[5]
        sq_off, cq_off = p[10:19], p[19:28]
        sq_size = sq_off[6] + sq_entries * 4
        cq_size = cq_off[5] + cq_entries * _CQE.size
        if features & _IORING_FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        self._sq = mmap.mmap(self.ring_fd, sq_size, offset=_IORING_OFF_SQ_RING)
        self._cq = (self._sq if features & _IORING_FEAT_SINGLE_MMAP
                    else mmap.mmap(self.ring_fd, cq_size, offset=_IORING_OFF_CQ_RING))
        self._sqes = mmap.mmap(self.ring_fd, sq_entries * _SQE_SIZE, offset=_IORING_OFF_SQES)
        self._sq_head, self._sq_tail, self._sq_array = sq_off[0], sq_off[1], sq_off[6]
        self._sq_mask = struct.unpack_from("<I", self._sq, sq_off[2])[0]
        self._sq_entries = sq_entries
        self._cq_head, self._cq_tail, self._cqes = cq_off[0], cq_off[1], cq_off[5]
        self._cq_mask = struct.unpack_from("<I", self._cq, cq_off[2])[0]
        self._to_submit = 0

    # -- submission ---------------------------------------------------------------------------------------------
    def _push(self, entry: RingEntry, cmd_op: int, commit_id: int, addr: int, length: int) -> None:
        """Queue one URING_CMD SQE for ``entry`` (the lock held)."""
        tail = struct.unpack_from("<I", self._sq, self._sq_tail)[0]
        head = struct.unpack_from("<I", self._sq, self._sq_head)[0]
        if tail - head >= self._sq_entries:
            self._enter(self._to_submit, 0, 0)
            self._to_submit = 0
        idx = tail & self._sq_mask
        off = idx * _SQE_SIZE  # (the fields not written here stay zero: the SQE array is mapped zeroed)
        _SQE_HEAD.pack_into(self._sqes, off, _IORING_OP_URING_CMD, 0, 0, self.fd, cmd_op, 0, addr, length, 0,
                            entry.index)
        _CMD_REQ.pack_into(self._sqes, off + 48, 0, commit_id, entry.qid)
        struct.pack_into("<I", self._sq, self._sq_array + 4 * idx, idx)
        struct.pack_into("<I", self._sq, self._sq_tail, (tail + 1) & 0xFFFFFFFF)  # (after the SQE: x86-64 TSO)
        self._to_submit += 1

    def _register(self, qid: int, payload_size: int) -> None:
        header = mmap.mmap(-1, mmap.PAGESIZE)
        payload = mmap.mmap(-1, payload_size)
        iov = (ctypes.c_uint64 * 4)(_address(header), _HEADER_SIZE, _address(payload), payload_size)
        entry = RingEntry(len(self.entries), qid, header, payload, iov)
        self.entries.append(entry)
        with self._lock:
            self._push(entry, FUSE_IO_URING_CMD_REGISTER, 0, ctypes.addressof(iov), 2)

    def submit(self) -> None:
        with self._lock:
            if self._to_submit:
                self._enter(self._to_submit, 0, 0)
                self._to_submit = 0

    def _enter(self, to_submit: int, min_complete: int, flags: int) -> int:
        while True:
            n = _libc.syscall(_SYS_IO_URING_ENTER, self.ring_fd, to_submit, min_complete, flags, None, 0)
            if n >= 0:
                return int(n)
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    # -- requests and answers -----------------------------------------------------------------------------------
    def next_request(self, buf: bytearray) -> RingRequest | None:
        """Wait for the next request and copy it into ``buf`` in the ``/dev/fuse`` layout; None once the
        connection ended (an entry completed with an error such as ENOTCONN)."""
        while True:
            with self._lock:
                to_submit, self._to_submit = self._to_submit, 0
            # Answers this thread queued go out before it takes the next request (their callers are waiting), with
            # the wait for requests when there is none yet: one system call. (A commit from another thread
            # meanwhile submits itself: only what was queued until now is counted.)
            if to_submit or not self._ready:
                self._enter(to_submit, 0 if self._ready else 1, _IORING_ENTER_GETEVENTS)
                self._reap()
            if self._ready:
                break
        index, res = self._ready.pop(0)
        if res < 0:
            return None
        entry = self.entries[index]
        self.taken += 1
        h = entry.header
        _flags, commit_id, payload_sz, _ = _ENT_IN_OUT.unpack_from(h, 256)
        entry.commit_id = commit_id
        length = abi.IN_HEADER.unpack_from(h, 0)[0]
        op_size = max(0, length - abi.IN_HEADER.size - payload_sz)
        if op_size > 128 or payload_sz > len(entry.payload) or length > len(buf):
            raise OSError(errno.EPROTO, f"ring request of {length} bytes does not fit its buffers")
        n = abi.IN_HEADER.size
        buf[:n] = h[:n]
        buf[n:n + op_size] = h[128:128 + op_size]
        buf[n + op_size:length] = entry.payload[:payload_sz]
        return RingRequest(entry, length)

    def _reap(self) -> None:
        head = struct.unpack_from("<I", self._cq, self._cq_head)[0]
        tail = struct.unpack_from("<I", self._cq, self._cq_tail)[0]
        while head != tail:
            user_data, res, _ = _CQE.unpack_from(self._cq, self._cqes + (head & self._cq_mask) * _CQE.size)
            self._ready.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self._cq, self._cq_head, head)

    def commit(self, entry: RingEntry, unique: int, err: int, payload: bytes | bytearray | memoryview, *,
               submit: bool = True) -> None:
        """Answer the request ``entry`` holds and give the entry back for the next one. ``submit=False`` (the
        thread that waits for requests next): the answer goes to the kernel with that wait, one system call for
        both."""
        size = len(payload)
        if size > len(entry.payload):
            raise OSError(errno.EOVERFLOW, f"an answer of {size} bytes does not fit the ring's buffer")
        entry.payload[:size] = payload
        abi.OUT_HEADER.pack_into(entry.header, 0, abi.OUT_HEADER.size + size, -err, unique)
        _ENT_IN_OUT.pack_into(entry.header, 256, 0, entry.commit_id, size, 0)
        with self._lock:
            self._push(entry, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, entry.commit_id, 0, 0)
            if submit:
                self._enter(self._to_submit, 0, 0)
                self._to_submit = 0

    def close(self) -> None:
        for m in (getattr(self, "_sqes", None), getattr(self, "_cq", None), getattr(self, "_sq", None)):
            if m is not None and not m.closed:
                m.close()
        if self.ring_fd >= 0:
            os.close(self.ring_fd)
            self.ring_fd = -1

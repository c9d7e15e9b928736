"""The FUSE request loop both file systems share: worker threads read requests from ``/dev/fuse``, decode the
header, call the handler for the opcode and write the reply. Errors become errno once, here
(:mod:`.errno_map`). INIT (the flags agreed), DESTROY and taking over from a daemon that died (the kernel asked to
send again what it had read) are answered here too, with hooks for what differs. A handler that would wait answers
a :class:`Call`, finished once the device is handed to another thread, through the loop's public replies
(:meth:`RequestLoop.reply`, :meth:`RequestLoop.answered`). :class:`~cachefs.fuse.session.FuseSession` (the
read-only dataset) and :class:`~cachefs.fuse.writable.WritableSession` (checkpoint volumes) add their handlers.
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, Literal, TypeAlias

from cachefs.fuse import kernel_abi as abi
from cachefs.fuse.errno_map import to_errno
from cachefs.fuse.kernel_abi import InitFlag, Op
from cachefs.fuse.order_channel import CALLER
from cachefs.fuse.request_metrics import RequestMetrics
from cachefs.fuse.uring import FuseRing, RingEntry, possible_cpus

__all__ = ["DEFERRED", "Answer", "Call", "Deferred", "RequestLoop"]

log = logging.getLogger("cachefs.fuse")


class Deferred(enum.Enum):
    """A handler's answer that comes later (from a callback), not now."""

    DEFERRED = "deferred"


DEFERRED: Final = Deferred.DEFERRED
#: What a request's handler answers now: the reply's payload, or DEFERRED.
Answer: TypeAlias = "bytes | bytearray | Literal[Deferred.DEFERRED]"
#: Set in ``unique`` of requests the kernel sends again after FUSE_NOTIFY_RESEND.
UNIQUE_RESEND = 1 << 63
#: The most pages in one request (READ, WRITE) asked for at INIT.
MAX_PAGES = 256
#: Ring entries per CPU queue with FUSE over io_uring: a request waiting on the origin holds its entry until it is
#: answered, so this is also how many such requests one CPU's callers can have before the next one waits.
RING_DEPTH = 16


class Call:
    """A request answered after the device is handed to another thread (see RequestLoop._lead): ``work()`` may
    wait (a read from the disk, a download, room for a write, an fsync) while the other threads go on reading
    requests. It answers the payload, DEFERRED (answered later by a callback of its own), or raises (an errno)."""

    __slots__ = ("nodeid", "opcode", "unique", "work")

    def __init__(self, unique: int, opcode: int, work: Callable[[], Answer], nodeid: int = 0) -> None:
        self.unique, self.opcode, self.work, self.nodeid = unique, opcode, work, nodeid

    def finish(self, loop: RequestLoop) -> None:
        started = loop.started_at(self.unique)
        try:
            payload = self.work()
        except BaseException as exc:  # noqa: BLE001 - every failure becomes an errno for the caller
            loop.reply(self.unique, to_errno(exc, f"{_op_name(self.opcode)} inode {self.nodeid}"))
            loop.answered(self.unique, self.opcode, started, ok=False)
            return
        if payload is not DEFERRED:
            loop.reply(self.unique, 0, payload)
            loop.answered(self.unique, self.opcode, started)


class RequestLoop:
    """Serves the mounted ``/dev/fuse`` descriptor ``fd`` with ``workers`` threads; ``ops`` maps opcodes to
    handlers ``(nodeid, unique, body) -> payload | DEFERRED | Call | None``."""

    def __init__(self, fd: int, *, workers: int, timeout: float, on_init: Callable[[Any], None] | None = None) -> None:
        self.fd = fd
        self.workers = max(1, workers)
        self.timeout = timeout
        self.mode = "starting"
        self.stopped = threading.Event()
        #: Called with the session once INIT is answered (the mount is usable, ``mode`` is known).
        self.on_init = on_init
        #: Counters `cachefs status` shows (the file system's own, shared).
        self.stats: dict[str, int] = {}
        self._lock = threading.Lock()
        self._turn = threading.Lock()  # held by the thread reading /dev/fuse (see _worker)
        self._inflight: dict[int, Future] = {}  # requests waiting on the event loop, by unique (INTERRUPT cancels)
        self._started: dict[int, float] = {}  # READs not answered yet: when they were read
        #: Requests answered, by opcode, and their times (kept here, added to the metrics once a second).
        self.metrics = RequestMetrics()
        #: Handlers by opcode (a file system adds its own).
        self.ops: dict[int, Callable[[int, int, memoryview], Any]] = {Op.INIT: self._init, Op.DESTROY: self._destroy}
        #: Ask the kernel for FUSE over io_uring at INIT (it offers it only when the fuse module allows it).
        self.want_uring = False
        #: The INIT flags agreed (by this daemon, or by the one it took over from: see :meth:`restored`).
        self.agreed = 0
        self.ring: FuseRing | None = None
        self._ring_turn = threading.Lock()  # held by the thread waiting on the ring (see _lead)
        self._ring_held: dict[int, RingEntry] = {}  # requests that came through the ring, by unique
        self._ring_leader = 0  # the thread holding _ring_turn

    # -- what a file system says (hooks) --------------------------------------------------------------------------
    def init_wants(self) -> int:
        """The INIT flags this file system asks the kernel for."""
        raise NotImplementedError

    def initialized(self, agreed: int) -> int:
        """INIT agreed on ``agreed`` (flags): set ``mode`` and whatever follows; the stack depth of backing files
        to announce (0: no passthrough)."""
        raise NotImplementedError

    def restored(self) -> bool:
        """A daemon that died is taken over: restore its state; whether it had answered INIT (the kernel does not
        send INIT again)."""
        return True

    def unhandled_errno(self, opcode: int) -> int:
        """The answer to an opcode without a handler."""
        return errno.ENOSYS

    def forget(self, items: list[tuple[int, int]]) -> None:
        """The kernel dropped ``nlookup`` references to each (nodeid, nlookup)."""

    # -- INIT, DESTROY, take-over ---------------------------------------------------------------------------------
    def _init(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        major, minor, max_readahead, flags = abi.INIT_IN_OLD.unpack_from(body)
        if major != abi.KERNEL_VERSION:
            raise OSError(errno.EPROTO, f"kernel FUSE protocol {major}.{minor}, need 7.x")
        offered = flags
        if flags & abi.InitFlag.INIT_EXT and len(body) >= abi.INIT_IN.size:
            offered |= abi.INIT_IN.unpack_from(body)[4] << 32
        agreed = (int(self.init_wants()) | (InitFlag.OVER_IO_URING if self.want_uring else 0)) & offered
        self.agreed = agreed
        stack_depth = self.initialized(agreed)
        log.info("FUSE %d.%d, flags 0x%x, mode %s", major, minor, agreed, self.mode)
        return abi.INIT_OUT.pack(abi.KERNEL_VERSION, abi.KERNEL_MINOR_VERSION, max_readahead, agreed & 0xFFFFFFFF,
                                 64, 48, abi.MAX_WRITE, 1, MAX_PAGES, 0, agreed >> 32, stack_depth)

    def _destroy(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self.stopped.set()
        return b""

    def _resume(self) -> None:
        """Take over from a daemon that died: its state (:meth:`restored`), then the kernel asked to send again
        every request the dead daemon had read but not answered."""
        answered_init = self.restored()
        if answered_init and self.agreed & InitFlag.OVER_IO_URING:
            self._start_ring()  # (before the resend: the kernel sends those through the ring once it is ready)
        try:
            os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size, abi.NOTIFY_RESEND, 0))
        except OSError as exc:  # kernels before 6.9: requests the old daemon had read stay unanswered
            log.warning("cannot ask the kernel to resend pending requests: %s", exc)
        log.info("resumed mount (mode %s)", self.mode)
        if answered_init and self.on_init is not None:
            self.on_init(self)

    # -- status -----------------------------------------------------------------------------------------------------
    def publish_every_second(self, publish: Callable[[int], object]) -> threading.Thread:
        """A thread that adds the request metrics up and calls ``publish(tick)`` (0, 1, ...) every second until
        the session stops: what ``cachefs status`` shows about the mount. A failure is logged, not fatal."""

        def run() -> None:
            tick = 0
            while True:
                try:
                    self.metrics.flush(self.stats)
                    if self.ring is not None:
                        self.stats["io_uring_requests"] = self.ring.taken
                    publish(tick)
                except Exception:
                    log.exception("mount statistics")
                if self.stopped.wait(1.0):
                    return
                tick += 1

        thread = threading.Thread(target=run, name="cachefs-fuse-stats", daemon=True)
        thread.start()
        return thread

    # -- replies (also for requests finished later: Call, callbacks) ----------------------------------------------
    def started_at(self, unique: int) -> float:
        """When request ``unique`` was read (READs are timed to their answer), else now."""
        return self._started.get(unique, time.perf_counter())

    # -- loop -----------------------------------------------------------------------------------------------
    def serve(self, *, resume: bool = False) -> None:
        """Run until the file system is unmounted (the device answers ENODEV). With ``resume``, take over a
        mount whose previous daemon died: its state comes from the journal, and the kernel is asked to send
        again every request the dead daemon had read but not answered."""
        if resume:
            self._resume()
        threads = [threading.Thread(target=self._worker, name=f"cachefs-fuse-{i}", daemon=True)
                   for i in range(self.workers)]
        for t in threads:
            t.start()
        while not self.stopped.wait(1.0):  # timed, so that signal handlers run (see csi.server.serve)
            pass
        for t in threads:
            t.join(timeout=0.1)

    def _worker(self) -> None:
        self._lead(self._turn, self._next_request)

    def _lead(self, turn: threading.Lock, take: Callable[[bytearray], int],
              after_turn: Callable[[], object] | None = None) -> None:
        """Leader/followers over a request source (``take``: the next request into the buffer, its length; 0: none
        now; -1: the source ended): one thread at a time holds ``turn``, takes requests and answers what is quick
        itself (lookups, opens, reads from the page cache: microseconds of Python). A request that would wait (a
        large READ, whose copy runs without the GIL, or a read from the disk) comes back as a :class:`Call`; this
        thread then lets a waiting one take the source and finishes that request meanwhile. Every thread reading at
        once measured half the rate on small files: each request then woke a second thread to fight over the GIL
        (bench/fuse_bench.py)."""
        buf = bytearray(abi.MAX_REQUEST)
        view = memoryview(buf)
        while not self.stopped.is_set():
            later = None
            with turn:
                while later is None:
                    n = take(buf)
                    if n < 0:
                        return
                    if not n:
                        break
                    later = self._handle(view[:n])
                if after_turn is not None:
                    after_turn()
            if later is not None:
                later.finish(self)

    # -- FUSE over io_uring ---------------------------------------------------------------------------------------
    def _start_ring(self) -> None:
        """Register ring entries on every CPU's queue and serve them beside ``/dev/fuse`` (which still brings
        FORGET and INTERRUPT). A ring that cannot be set up leaves every request on ``/dev/fuse``: the kernel
        switches to the ring only once each queue has an entry."""
        try:
            self.ring = FuseRing(self.fd, queues=possible_cpus(), depth=RING_DEPTH,
                                 payload_size=max(abi.MAX_WRITE, MAX_PAGES * mmap.PAGESIZE))
        except OSError as exc:
            log.warning("FUSE over io_uring agreed but not set up (%s): requests stay on /dev/fuse", exc)
            return
        self.stats["io_uring_queues"] = possible_cpus()
        log.info("serving through io_uring: %d queues of %d entries", possible_cpus(), RING_DEPTH)
        for i in range(self.workers):
            threading.Thread(target=self._lead, args=(self._ring_turn, self._next_from_ring, self._ring_turn_over),
                             name=f"cachefs-fuse-ring-{i}", daemon=True).start()

    def _next_from_ring(self, buf: bytearray) -> int:
        """:meth:`_lead`'s source for the ring: the next request's length (-1: the connection ended, unmounted or
        aborted; /dev/fuse says so too). The request's ring entry is kept for its answer."""
        assert self.ring is not None
        self._ring_leader = threading.get_ident()
        try:
            got = self.ring.next_request(buf)
        except OSError as exc:
            log.error("FUSE ring: %s", exc)
            got = None
        if got is None:
            return -1
        self._ring_held[abi.IN_HEADER.unpack_from(buf)[2]] = got.entry
        return got.size

    def _ring_turn_over(self) -> None:
        """Answers the leaving leader queued go now (the next leader may be a while)."""
        self._ring_leader = 0
        assert self.ring is not None
        self.ring.submit()

    def _next_request(self, buf: bytearray) -> int:
        """Read one request (its length), or 0 when there is none to handle (retry, or the session ended)."""
        while not self.stopped.is_set():
            try:
                n = os.readv(self.fd, [buf])
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                if exc.errno != errno.ENODEV:
                    log.error("reading /dev/fuse: %s", exc)
                self.stopped.set()
                return 0
            if n >= abi.IN_HEADER.size:
                return n
        return 0

    def _handle(self, req: memoryview) -> Call | None:
        started = time.perf_counter()
        length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = abi.IN_HEADER.unpack_from(req)
        CALLER.set((uid, gid, pid))
        body = req[abi.IN_HEADER.size:length - 8 * extlen]  # extension headers (8-byte units) sit at the end
        if opcode in _UNANSWERED:
            try:
                self._unanswered(opcode, nodeid, body)
            except struct.error:  # truncated: the kernel expects no answer, so there is nobody to tell
                log.warning("ignored a malformed %s request (%d bytes)", _op_name(opcode), len(req))
            return None
        if unique & UNIQUE_RESEND:
            self.stats["resent_requests"] = self.stats.get("resent_requests", 0) + 1
        handler = self.ops.get(opcode)
        if handler is None:
            self.reply(unique, self.unhandled_errno(opcode))
            self.metrics.answered(opcode, started, ok=False)
            return None
        if opcode == Op.READ:
            self._started[unique] = started  # (a READ answered later is timed to its answer)
        try:
            payload = handler(nodeid, unique, body)
        except struct.error:  # a request shorter than its opcode's arguments
            log.warning("malformed %s request (%d bytes)", _op_name(opcode), len(req))
            self.reply(unique, errno.EINVAL)
            self.answered(unique, opcode, started, ok=False)
            return None
        except BaseException as exc:  # noqa: BLE001 - every failure becomes an errno for the caller
            self.reply(unique, to_errno(exc, f"{_op_name(opcode)} inode {nodeid}"))
            self.answered(unique, opcode, started, ok=False)
            return None
        if payload is DEFERRED:
            return None  # answered when its fetch completes
        if isinstance(payload, Call):
            return payload  # answered once the device is handed on
        if payload is not None:
            self.reply(unique, 0, payload)
        self.answered(unique, opcode, started)
        if opcode == Op.INIT:
            if self.agreed & InitFlag.OVER_IO_URING:
                self._start_ring()
            if self.on_init is not None:
                self.on_init(self)
        return None

    def _interrupt(self, unique: int) -> None:
        """The caller gave up (a signal): cancel its fetch and answer EINTR now."""
        with self._lock:
            fut = self._inflight.pop(unique, None)
        if fut is None:
            return  # already answered (or never waited)
        fut.cancel()
        self.stats["interrupted"] = self.stats.get("interrupted", 0) + 1
        self.reply(unique, errno.EINTR)

    def reply(self, unique: int, err: int, payload: bytes | bytearray = b"") -> None:
        entry = self._ring_held.pop(unique, None) if self._ring_held else None
        if entry is not None:
            assert self.ring is not None
            try:  # (the thread that takes the ring's next request sends its own answers with that wait)
                self.ring.commit(entry, unique, err, payload, submit=threading.get_ident() != self._ring_leader)
            except OSError as exc:
                log.warning("replying to request %d through the ring: %s", unique, exc)
            return
        try:
            head = abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(payload), -err, unique)
            if len(payload) > 4096:  # large READ answers: gather, do not copy the payload behind the header
                os.writev(self.fd, [head, payload])
            else:
                os.write(self.fd, head + payload)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                self.stopped.set()
            elif exc.errno != errno.ENOENT:  # ENOENT: the request was interrupted meanwhile
                log.warning("replying to request %d: %s", unique, exc)

    def _unanswered(self, opcode: int, nodeid: int, body: memoryview) -> None:
        """FORGET, BATCH_FORGET and INTERRUPT: the kernel waits for no answer."""
        if opcode == Op.FORGET:
            self.forget([(nodeid, abi.FORGET_IN.unpack_from(body)[0])])
        elif opcode == Op.BATCH_FORGET:
            count, _ = abi.BATCH_FORGET_IN.unpack_from(body)
            count = min(count, (len(body) - abi.BATCH_FORGET_IN.size) // abi.FORGET_ONE.size)
            self.forget([abi.FORGET_ONE.unpack_from(body, abi.BATCH_FORGET_IN.size + i * abi.FORGET_ONE.size)
                         for i in range(count)])
        else:
            self._interrupt(abi.INTERRUPT_IN.unpack_from(body)[0])

    def answered(self, unique: int, opcode: int, started: float, ok: bool = True) -> None:
        if opcode == Op.READ:
            self._started.pop(unique, None)
        self.metrics.answered(opcode, started, ok=ok)


_UNANSWERED = frozenset({Op.FORGET, Op.BATCH_FORGET, Op.INTERRUPT})


def _op_name(opcode: int) -> str:
    try:
        return Op(opcode).name
    except ValueError:
        return f"opcode {opcode}"

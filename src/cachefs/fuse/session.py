"""The FUSE request loop: worker threads read requests from ``/dev/fuse``, decode them (:mod:`.kernel_abi`), call
the file system (:mod:`.fs`) and write replies. Errors become errno once, here (:mod:`.errno_map`).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
from collections.abc import Callable
from typing import Literal

from cachefs.base.aio import get_loop
from cachefs.engine import WOULD_WAIT
from cachefs.fuse import kernel_abi as abi
from cachefs.fuse.errno_map import to_errno
from cachefs.fuse.fs import CacheFS
from cachefs.fuse.kernel_abi import InitFlag, Op, OpenFlag
from cachefs.fuse.request_loop import DEFERRED, Answer, Call, Deferred, RequestLoop
from cachefs.fuse.tree import TreeReplies

__all__ = ["FuseSession"]

log = logging.getLogger("cachefs.fuse")

#: READs larger than this are answered while another thread reads the next request (see ``RequestLoop._lead``).
HANDOVER_READ = 128 * 1024


class FuseSession(RequestLoop):
    """Serves ``fs`` on the mounted ``/dev/fuse`` descriptor ``fd`` with ``workers`` threads."""

    def __init__(self, fs: CacheFS, fd: int, *, workers: int = 2, timeout: float = 3600.0,
                 passthrough: bool = True, skip_opens: bool = True, io_uring: bool = False,
                 on_init: Callable[[FuseSession], None] | None = None) -> None:
        super().__init__(fd, workers=workers, timeout=timeout, on_init=on_init)
        self.want_uring = io_uring
        self.fs = fs
        self.stats = fs.stats
        self.want_passthrough = passthrough
        #: May OPEN be answered ENOSYS once no file needs one (see maybe_skip_opens); and is it now.
        self.skip_opens = skip_opens
        self.opens_skipped = False
        self.tree = TreeReplies(fs, timeout)
        self.ops.update({Op.OPEN: self._open, Op.READ: self._read, Op.RELEASE: self._release, **self.tree.ops()})
        # (FLUSH is not here: answered ENOSYS, the kernel never sends it again: read-only, nothing to flush)

    def unhandled_errno(self, opcode: int) -> int:
        return errno.EROFS if opcode in abi.WRITE_OPS else errno.ENOSYS

    def forget(self, items: list[tuple[int, int]]) -> None:
        self.fs.forget(items)

    def restored(self) -> bool:
        journal = self.fs.journal
        assert journal is not None, "a resumed session has its mount's journal"
        init = journal.state.init
        if init is not None:  # the previous daemon answered INIT; the kernel will not send it again
            self.fs.passthrough = init["mode"] == "passthrough"
            self.mode = init["mode"]
            self.agreed = int(init["flags"])
            self.fs.restore()
        # Whether a previous daemon refused an OPEN (then the kernel sends none, whatever we decide now).
        self.opens_skipped = journal.state.opens_skipped
        log.info("taking over the mount (daemon generation %d)", journal.state.generation)
        return init is not None

    # -- INIT -------------------------------------------------------------------------------------------------
    def init_wants(self) -> int:
        # Always READDIRPLUS (no _AUTO): attributes come from the frozen manifest at no extra cost, and with
        # _AUTO the kernel uses plain READDIR after a directory's first chunk, so `os.walk` + `stat` of a large
        # directory costs a LOOKUP per entry (bench/manifest_bench.py measured 7.4× a local tree that way).
        want = (InitFlag.ASYNC_READ | InitFlag.BIG_WRITES | InitFlag.PARALLEL_DIROPS | InitFlag.MAX_PAGES
                | InitFlag.DO_READDIRPLUS | InitFlag.INIT_EXT | InitFlag.DIRECT_IO_ALLOW_MMAP)
        if self.want_passthrough and os.geteuid() == 0:
            want |= InitFlag.PASSTHROUGH
        return int(want)

    def initialized(self, agreed: int) -> int:
        passthrough = bool(agreed & InitFlag.PASSTHROUGH)
        self.fs.passthrough = passthrough
        self.mode = "passthrough" if passthrough else "userspace"
        if self.fs.journal is not None:
            self.fs.journal.init(self.mode, agreed, self.fs.ds.version)
        return abi.MAX_STACK_DEPTH if passthrough else 0

    def maybe_skip_opens(self) -> bool:
        """From now on answer OPEN with ENOSYS, so that the kernel stops sending OPEN and RELEASE, if no file
        needs them (CacheFS.opens_needed; may walk the manifest, so not from a request thread). True if so."""
        if self.skip_opens and not self.opens_skipped and self.mode != "starting" and \
                not self.fs.opens_needed(check_local=self.fs.passthrough):
            if self.fs.journal is not None:  # before any OPEN is refused: the kernel's choice outlives us
                self.fs.journal.skip_opens()
            self.opens_skipped = True
            log.info("every file is a packed small file on this node: the kernel opens files without asking")
        return self.opens_skipped

    def _open(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        if self.opens_skipped:
            self.fs.stats["opens_refused"] += 1
            raise OSError(errno.ENOSYS, "open-less mode")  # the kernel sets no_open: no more OPEN or RELEASE
        flags, _ = abi.OPEN_IN.unpack_from(body)
        fh, h = self.fs.open(nodeid, flags)
        # NOFLUSH: read-only, nothing to flush at close, so the kernel need not ask.
        if h.passthrough:
            return abi.OPEN_OUT.pack(fh, OpenFlag.PASSTHROUGH | OpenFlag.NOFLUSH, self.fs.backing_id(h))
        if h.prefill is not None:
            self._store(nodeid, h.prefill)
            h.prefill = None
        cache = OpenFlag.KEEP_CACHE if h.page_cache else OpenFlag.DIRECT_IO  # see Handle.page_cache
        return abi.OPEN_OUT.pack(fh, cache | OpenFlag.NOFLUSH, 0)

    def _store(self, nodeid: int, data: bytes | bytearray) -> None:
        """Put ``data`` (the whole file) into the inode's page cache. Then the reader's first read is a page
        cache hit: a small file costs LOOKUP, OPEN and RELEASE through here, not a READ as well. Any failure
        leaves the pages to be read the usual way."""
        try:
            os.writev(self.fd, [abi.pack_notify_store(nodeid, 0, len(data)), data])
            self.fs.stats["prefilled_bytes"] += len(data)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                self.stopped.set()
            elif exc.errno != errno.ENOENT:  # ENOENT: the kernel dropped the inode meanwhile
                log.warning("the kernel refused FUSE_NOTIFY_STORE (%s): small files are read by READ", exc)
                self.fs.prefill = False

    def _read(self, nodeid: int, unique: int, body: memoryview) -> Answer | Call:
        """Bytes in the page cache are answered at once; large reads and reads from the disk after the device
        is handed on (a :class:`~.request_loop.Call`); a fetch from the origin when it completes, so a slow
        origin never holds a request thread (and an INTERRUPT can cancel it)."""
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        if size > HANDOVER_READ:
            return self._later(unique, nodeid, fh, offset, size)
        data = self.fs.read_local(nodeid, fh, offset, size, wait=False)
        if data is WOULD_WAIT:
            return self._later(unique, nodeid, fh, offset, size)
        return self._fetch(unique, nodeid, fh, offset, size) if data is None else data

    def _later(self, unique: int, nodeid: int, fh: int, offset: int, size: int) -> Call:
        return Call(unique, Op.READ, functools.partial(self._read_waiting, unique, nodeid, fh, offset, size), nodeid)

    def _read_waiting(self, unique: int, nodeid: int, fh: int, offset: int, size: int) -> Answer:
        data = self.fs.read_local(nodeid, fh, offset, size)
        if data is None or data is WOULD_WAIT:  # (a read that may wait never answers WOULD_WAIT)
            return self._fetch(unique, nodeid, fh, offset, size)
        return data

    def _fetch(self, unique: int, nodeid: int, fh: int, offset: int, size: int) -> Literal[Deferred.DEFERRED]:
        with self._lock:  # held until registered: the completion callback takes the same lock
            fut = asyncio.run_coroutine_threadsafe(self.fs.fetch(nodeid, fh, offset, size), get_loop())
            self._inflight[unique] = fut
        fut.add_done_callback(lambda f: self._fetched(unique, nodeid, f))
        return DEFERRED

    def _fetched(self, unique: int, nodeid: int, fut) -> None:
        started = self._started.pop(unique, None)
        with self._lock:
            if self._inflight.pop(unique, None) is None:
                return  # interrupted: already answered EINTR
        if fut.cancelled():
            self.reply(unique, errno.EINTR)
            self.metrics.answered(Op.READ, started, ok=False)
            return
        exc = fut.exception()
        if exc is not None:
            self.reply(unique, to_errno(exc, f"READ inode {nodeid}"))
        else:
            self.reply(unique, 0, fut.result())
        self.metrics.answered(Op.READ, started, ok=exc is None)

    def _release(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self.fs.release(nodeid, abi.RELEASE_IN.unpack_from(body)[0])
        return b""

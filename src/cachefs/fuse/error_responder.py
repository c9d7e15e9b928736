"""Answering the kernel's FUSE requests with errors while no daemon can: what a holder does once its mount has gone
unserved for too long (:mod:`.holder`), so that readers fail instead of waiting forever."""

from __future__ import annotations

import errno
import os
import select
import signal
import threading

from cachefs.fuse import kernel_abi as abi

__all__ = ["ErrorResponder"]


class ErrorResponder:
    """Answers the kernel's requests on ``fd`` with errors while no daemon can: EIO, ENOTCONN for STATFS (so
    that ``df`` and health checks see a broken mount), nothing for requests that take no answer."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.answered = 0
        self._lock = threading.Lock()
        self._thread: tuple[threading.Thread, threading.Event] | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                # Each thread has a stop event of its own: a start right after a stop must not un-stop the
                # thread that stop() is waiting for.
                stop = threading.Event()
                t = threading.Thread(target=self._run, args=(stop,), name="cachefs-fuse-fallback", daemon=True)
                self._thread = (t, stop)
                t.start()

    def stop(self) -> None:
        """Stop answering; returns once no request will be read here any more."""
        with self._lock:
            running, self._thread = self._thread, None
        if running is not None:
            t, stop = running
            stop.set()
            t.join()

    def _run(self, stop: threading.Event) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        # Requests a killed daemon had read are pending in the kernel, not queued: asked again here, they get
        # their error too instead of waiting for a daemon that may never come (kernels >= 6.9).
        try:
            os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size, abi.NOTIFY_RESEND, 0))
        except OSError:
            pass
        buf = bytearray(abi.MAX_REQUEST)
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while not stop.is_set():
            if not poller.poll(100):  # short, so that stop() returns quickly
                continue
            try:
                n = os.readv(self.fd, [buf])
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: unmounted
            if n < abi.IN_HEADER.size:
                continue
            _len, opcode, unique = abi.IN_HEADER.unpack_from(buf)[:3]
            if opcode in (abi.Op.FORGET, abi.Op.BATCH_FORGET, abi.Op.INTERRUPT):
                continue
            err = errno.ENOTCONN if opcode == abi.Op.STATFS else errno.EIO
            try:
                os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -err, unique))
                self.answered += 1
            except OSError:
                pass

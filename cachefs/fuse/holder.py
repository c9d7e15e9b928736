"""Keeping a mount alive across daemon restarts: a small long-lived holder owns the ``/dev/fuse``
descriptor and hands it to each daemon over a unix socket (``SCM_RIGHTS``).

While any process holds the descriptor the kernel keeps the mount connected, so a daemon that crashes or is
killed leaves readers waiting instead of failing with ENOTCONN; the next daemon gets the same descriptor,
replays the mount journal (:mod:`.journal`) and asks the kernel to resend what the dead one had read.

:class:`MountHolder` mounts, serves the hand-over socket and restarts the daemon command it is given;
:func:`receive_fd` is the daemon's side. The CSI node plugin holds its mounts the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time

from ..errors import CacheFSError, ConfigError
from .mount import is_fuse_mount, is_stale_mount, open_and_mount, set_read_ahead, unmount

__all__ = ["MountHolder", "receive_fd", "socket_path_for", "start_holder"]

log = logging.getLogger("cachefs.fuse")

#: Kernel read-ahead on our mounts: 1 MiB READ requests on the userspace path (the INIT reply allows them).
READ_AHEAD_KIB = 1024
#: Longest unix socket path the kernel takes (sun_path is 108 bytes with its NUL).
_SUN_PATH_MAX = 107


def socket_path_for(path: str) -> str:
    """``path`` for a unix socket, or a short name in /tmp derived from it if it is too long to bind."""
    if len(path.encode()) > _SUN_PATH_MAX:
        path = os.path.join("/tmp", f"cachefs-{hashlib.blake2b(path.encode(), digest_size=8).hexdigest()}.sock")
    return path


def start_holder(argv: list[str], mountpoint: str, log_path: str, *, env: dict[str, str] | None = None,
                 timeout: float = 120.0) -> subprocess.Popen:
    """Run ``argv`` (a ``cachefs mount … --foreground`` command: a holder) in its own session, its output
    appended to ``log_path``, and return it once ``mountpoint`` is mounted. The caller owns the child (and
    reaps it); :class:`CacheFSError` with the log's last line if it exits or does not mount in time."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read().strip().splitlines()[-1:] or ["(no output)"]
            raise CacheFSError(f"mount {mountpoint} failed: {tail[0]}")
        if is_fuse_mount(mountpoint):
            return proc
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise CacheFSError(f"mount {mountpoint}: not mounted after {timeout:.0f} s (log {log_path})")


def receive_fd(socket_path: str, timeout: float = 10.0) -> tuple[int, dict]:
    """Connect to a holder and receive its ``/dev/fuse`` descriptor and the facts it sends along
    (``mountpoint``, ``generation``: how many daemons it started before this one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(socket_path)
            msg, fds, _flags, _addr = socket.recv_fds(s, 4096, 1)
        except OSError as exc:
            raise CacheFSError(f"no mount holder at {socket_path}: {exc}") from None
    if not fds:
        raise CacheFSError(f"mount holder at {socket_path} sent no descriptor")
    return fds[0], json.loads(msg)


class MountHolder:
    """Owns the FUSE descriptor of one mount for the mount's whole life.

    ``daemon_argv`` is the command of the serving daemon; it is started with ``CACHEFS_FUSE_HOLDER`` set to
    the socket path and restarted whenever it dies while the file system is still mounted. It exits 0 once
    the file system is unmounted, and then the holder is done too.
    """

    def __init__(self, mountpoint: str, socket_path: str, *, restart_delay: float = 0.2,
                 max_restart_delay: float = 5.0) -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self.socket_path = socket_path
        self.restart_delay, self.max_restart_delay = restart_delay, max_restart_delay
        self.fd = -1
        self.generation = 0  # daemons started so far
        self.daemon: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None

    # -- mount ----------------------------------------------------------------------------------------------
    def mount(self) -> None:
        """Clean a stale mount left by a dead daemon and holder, open ``/dev/fuse`` and mount it."""
        if is_stale_mount(self.mountpoint):
            log.warning("%s: cleaning up a stale mount (its daemon is gone)", self.mountpoint)
            unmount(self.mountpoint)
        if not os.path.isdir(self.mountpoint):
            raise ConfigError(f"mount point {self.mountpoint!r} is not a directory")
        self.fd = open_and_mount(self.mountpoint)
        set_read_ahead(self.mountpoint, READ_AHEAD_KIB)
        self._listen()

    def _listen(self) -> None:
        os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lst.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)  # the descriptor is the whole file system: owner only
        lst.listen(8)
        self._listener = lst
        threading.Thread(target=self._hand_over_loop, name="cachefs-fuse-holder", daemon=True).start()

    def _hand_over_loop(self) -> None:
        # SIGTERM/SIGINT must reach the main thread, which waits for the daemon: a handler only runs there.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with conn:
                msg = json.dumps({"mountpoint": self.mountpoint, "generation": self.generation - 1}).encode()
                try:
                    socket.send_fds(conn, [msg], [self.fd])
                except OSError as exc:
                    log.warning("handing the FUSE descriptor over: %s", exc)

    # -- daemon ---------------------------------------------------------------------------------------------
    def run(self, daemon_argv: list[str], *, env: dict | None = None) -> int:
        """Start the daemon and restart it until the file system is unmounted; returns the last exit code."""
        delay = self.restart_delay
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, lambda *_: self.stop())
            except ValueError:  # not the main thread: the caller handles signals
                break
        rc = 0
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                self.generation += 1
                self.daemon = subprocess.Popen(daemon_argv, env={**(env or os.environ),
                                                                 "CACHEFS_FUSE_HOLDER": self.socket_path})
                rc = self.daemon.wait()
                if rc == 0 or self._stopping.is_set() or not is_fuse_mount(self.mountpoint):
                    break
                if time.monotonic() - started > 30:
                    delay = self.restart_delay  # it ran for a while: a fresh failure, not a crash loop
                log.warning("%s: FUSE daemon exited (%s); restarting it in %.1f s (readers wait meanwhile)",
                            self.mountpoint, _describe(rc), delay)
                if self._stopping.wait(delay):
                    break
                delay = min(delay * 2, self.max_restart_delay)
        finally:
            self.close()
        return rc

    def stop(self) -> None:
        """Unmount and let the daemon finish (it sees the unmount and exits)."""
        self._stopping.set()
        try:
            unmount(self.mountpoint)
        except CacheFSError as exc:
            log.warning("%s", exc)
        d = self.daemon
        if d is not None and d.poll() is None:
            threading.Timer(10.0, _kill, args=(d,)).start()

    def close(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"

"""Keeping a mount alive across daemon restarts: a small long-lived holder owns the ``/dev/fuse``
descriptor and hands it to each daemon over a unix socket (``SCM_RIGHTS``).

While any process holds the descriptor the kernel keeps the mount connected, so a daemon that crashes or is
killed leaves readers waiting instead of failing with ENOTCONN; the next daemon gets the same descriptor,
replays the mount journal (:mod:`.journal`) and asks the kernel to resend what the dead one had read.

A daemon that cannot start (the dataset no longer opens: credentials refused, the origin gone, and no
manifest on the node) must not leave readers waiting forever. Once no daemon has served the mount for
``answer_after`` seconds, the holder answers the kernel itself, every request with EIO (STATFS with
ENOTCONN), those the dead daemon had read included (it asks the kernel to resend them), while it keeps trying
to start one with a growing delay; a daemon that comes up asks the holder to
stop answering before it reads a request (:func:`~.handover.announce_ready`). The holder's state (starting, serving,
failing and why) is in the mount records (:mod:`cachefs.index.mounts`) for ``cachefs status``.

The socket protocol: a client sends one JSON line, ``{"op": "attach"}`` (answered with the descriptor and
``{"mountpoint", "generation"}``), ``{"op": "ready"}`` or ``{"op": "failed", "reason": …}`` (answered
``{"ok": true}``), and ``{"op": "retire"}``: the next node pod generation's holder, which holds a copy of the
descriptor (from this holder's session keeper), takes the mount over; this holder kills its daemon (what it had read
the next one asks the kernel to resend, as after a crash), gives up its socket and its record, answers
``{"ok": true}`` and exits without unmounting.

:class:`MountHolder` mounts, serves the hand-over socket and restarts the daemon command it is given;
:mod:`.handover` is the daemon's side. The CSI node plugin holds its mounts the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time

from cachefs import __version__
from cachefs.base import metrics
from cachefs.base.early_start import EarlyChild
from cachefs.base.errors import (
    CacheFSError,
    ConfigError,
)
from cachefs.fuse.error_responder import ErrorResponder
from cachefs.fuse.holder_process import check_empty
from cachefs.fuse.mount import is_fuse_mount, is_stale_mount, open_and_mount, set_read_ahead, unmount
from cachefs.index.mounts import forget_holder, record_holder

__all__ = ["MountHolder"]

log = logging.getLogger("cachefs.fuse")

#: Kernel read-ahead on our mounts: 1 MiB READ requests on the userspace path (the INIT reply allows them).
READ_AHEAD_KIB = 1024
#: How often a holder checks that the session keeper still holds its descriptor.
KEEPER_CHECK = 3.0
class MountHolder:
    """Owns the FUSE descriptor of one mount for the mount's whole life.

    ``daemon_argv`` is the command of the serving daemon (it names the holder's socket); it is started and
    restarted whenever it dies while the file system is still mounted. It exits 0 once
    the file system is unmounted, and then the holder is done too. With ``cache_dir``, the holder's state is
    recorded for ``cachefs status`` (see :mod:`cachefs.index.mounts`).
    """

    def __init__(self, mountpoint: str, socket_path: str, *, url: str = "", cache_dir: str | None = None,
                 restart_delay: float = 0.2, max_restart_delay: float = 5.0, answer_after: float = 10.0,
                 max_failing_delay: float = 30.0, allow_other: bool = False, nonempty: bool = False,
                 writable: bool = False, keeper: str = "", restart_argv: list[str] | None = None) -> None:
        """``allow_other``: every user of the node may read the mount (by default only the one who mounted it);
        ``nonempty``: mount over a directory that has entries (hidden until unmounted); ``writable``: a checkpoint
        volume, mounted read-write; ``keeper``: the socket of a :class:`~.keeper.SessionKeeper` that keeps a copy
        of the descriptor (so the mount outlives this process), with ``restart_argv``, this holder's own command,
        to start another one on it (:meth:`adopt`)."""
        self.mountpoint = os.path.abspath(mountpoint)
        self.allow_other, self.nonempty, self.writable = allow_other, nonempty, writable
        self.socket_path = socket_path
        self.url, self.cache_dir = url, cache_dir
        self.keeper, self.restart_argv = keeper, list(restart_argv or [])
        self.restart_delay, self.max_restart_delay = restart_delay, max_restart_delay
        #: Seconds without a serving daemon after which the holder answers requests itself (with errors).
        self.answer_after = answer_after
        #: The longest wait between attempts to start a daemon that keeps failing to start.
        self.max_failing_delay = max_failing_delay
        self.fd = -1
        self.generation = 0  # daemons started so far
        self.daemon: subprocess.Popen | None = None
        self.state, self.reason = "starting", ""
        self.responder: ErrorResponder | None = None
        self._served = False  # some daemon served this mount (the kernel's INIT is answered)
        self.retired = False  # the next node pod generation took the mount over
        self.adopted_env: dict[str, str] = {}  # the credentials an adopted mount's keeper copy carried
        self._ready = threading.Event()  # the current daemon serves
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._state_lock = threading.Lock()
        #: Held while the error responder starts, and while a daemon that announced itself ready takes over.
        self._responder_lock = threading.Lock()

    # -- mount ----------------------------------------------------------------------------------------------
    def mount(self) -> None:
        """Clean a stale mount left by a dead daemon and holder, open ``/dev/fuse`` and mount it."""
        if is_stale_mount(self.mountpoint):
            log.warning("%s: cleaning up a stale mount (its daemon is gone)", self.mountpoint)
            unmount(self.mountpoint)
        if not os.path.exists(self.mountpoint):
            raise ConfigError(f"mount point {self.mountpoint} does not exist")
        if not os.path.isdir(self.mountpoint):
            raise ConfigError(f"mount point {self.mountpoint} is not a directory")
        if not self.nonempty:
            check_empty(self.mountpoint)
        self.fd = open_and_mount(self.mountpoint, allow_other=self.allow_other, writable=self.writable)
        try:
            self.responder = ErrorResponder(self.fd)
            set_read_ahead(self.mountpoint, READ_AHEAD_KIB)
            self._listen()
            self._set_state("starting", "")
        except BaseException:  # a mount that cannot be served is never left behind
            unmount(self.mountpoint)
            self.close()
            raise
        self._start_keeping()

    def adopt(self, predecessor: str = "") -> None:
        """Hold a mount whose holder died, on the copy of its descriptor the keeper kept: the mount is served
        already (the daemon this holder starts resumes from the mount journal) and readers waited meanwhile.

        ``predecessor``: the session keeper of the previous node pod generation, whose holder still serves the
        mount; it is asked to retire once the copy is taken (readers wait from then until this holder's daemon
        serves), and that keeper to let go of its copy."""
        from cachefs.fuse.handover import retire_holder
        from cachefs.fuse.keeper import drop_session, take_session

        if not self.keeper:
            raise ConfigError("adopting a mount needs the session keeper's socket (CACHEFS_SESSION_KEEPER)")
        self.fd, meta, env = take_session(predecessor or self.keeper, self.mountpoint)
        os.environ.update(env)  # the volume's credentials, for its daemons (and this holder's next deposit)
        self.adopted_env = dict(env)  # (for a first daemon started before they were known)
        if predecessor:
            # Before listening: the previous holder's socket has this path, and it removes it as it retires.
            retired = retire_holder(str(meta.get("socket") or self.socket_path))
            with contextlib.suppress(CacheFSError):
                drop_session(predecessor, self.mountpoint)
            meta = {**meta, "generation": max(int(meta.get("generation", 1)), 1)}
            log.warning("%s: took the mount over from the previous node pod generation (its holder %s)",
                        self.mountpoint, "retired" if retired else "was gone")
        else:
            log.warning("%s: adopted the mount from the session keeper (its holder %s is gone)", self.mountpoint,
                        meta.get("pid"))
        self.generation = max(1, int(meta.get("generation", 1)))  # its first daemon resumes, never expects INIT
        self._served = True
        self.responder = ErrorResponder(self.fd)
        self._listen()
        self._set_state("starting", "")
        self._start_keeping()

    # -- the keeper's copy --------------------------------------------------------------------------------------
    def _deposit(self) -> None:
        from cachefs.fuse.keeper import HANDOVER_VERSION, KEPT_ENV, keep_session

        meta = {"argv": self.restart_argv, "generation": self.generation, "pid": os.getpid(),
                "handover": HANDOVER_VERSION, "release": __version__,
                "socket": self.socket_path, "url": self.url, "cache_dir": self.cache_dir or ""}
        keep_session(self.keeper, self.mountpoint, self.fd, meta,
                     {k: os.environ[k] for k in KEPT_ENV if k in os.environ})

    def _start_keeping(self) -> None:
        """Deposit the descriptor with the keeper, and again whenever the keeper lost it (its process restarted)."""
        if not self.keeper:
            return

        def loop() -> None:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            from cachefs.fuse.keeper import has_session

            while not self._stopping.wait(KEEPER_CHECK):
                try:
                    if self.fd >= 0 and not self.retired and not has_session(self.keeper, self.mountpoint,
                                                                              os.getpid()):
                        self._deposit()
                except CacheFSError as exc:  # the keeper restarting: the next round tries again
                    log.debug("%s: %s", self.mountpoint, exc)

        try:
            self._deposit()
        except CacheFSError as exc:
            log.warning("%s: %s (the mount ends with this holder until the keeper is back)", self.mountpoint, exc)
        threading.Thread(target=loop, name="cachefs-fuse-keeper", daemon=True).start()

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
        threading.Thread(target=self._hand_over_loop, args=(lst,), name="cachefs-fuse-holder", daemon=True).start()

    def _hand_over_loop(self, listener: socket.socket) -> None:
        # SIGTERM/SIGINT must reach the main thread, which waits for the daemon: a handler only runs there.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except (OSError, ValueError) as exc:
                    log.warning("mount holder socket: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        line = conn.makefile("rb").readline(65536)
        request = json.loads(line) if line.strip() else {}
        op = request.get("op") if isinstance(request, dict) else None
        if op == "attach":
            msg = json.dumps({"mountpoint": self.mountpoint, "generation": self.generation - 1}).encode()
            socket.send_fds(conn, [msg], [self.fd])
            return
        if op == "retire":
            self._retire(conn)
            return
        if op == "ready":
            with self._responder_lock:  # (so that _fail_open cannot start answering again meanwhile)
                self._ready.set()
                if self.responder is not None:
                    self.responder.stop()  # before the daemon reads its first request
            self._served = True
            self._set_state("serving", "")
        elif op == "failed":
            self._set_state(self.state, str(request.get("reason", ""))[:1000])
        else:
            raise ValueError(f"unknown request {op!r}")
        conn.sendall(b'{"ok": true}\n')

    def _retire(self, conn: socket.socket) -> None:
        """Let the next generation's holder take the mount: stop the daemon, give up the socket and the mount
        record (both are the successor's from now on), answer, then let go of the descriptor."""
        self._stopping.set()  # (the run loop ends once the daemon is gone, without restarting it)
        with self._responder_lock:  # (answering with errors itself, it would take the successor's requests)
            if self.responder is not None:
                self.responder.stop()
        d = self.daemon
        if d is not None and d.poll() is None:
            d.kill()  # as a crash: the journal is written before each reply, and the next daemon resumes
            d.wait()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        if self.cache_dir:
            forget_holder(self.cache_dir, self.mountpoint)
            self.cache_dir = None
        self.retired = True
        conn.sendall(b'{"ok": true}\n')
        log.warning("%s: retired: the next node pod generation serves the mount", self.mountpoint)

    def _set_state(self, state: str, reason: str) -> None:
        with self._state_lock:
            self.state, self.reason = state, reason
            metrics.safely(lambda: metrics.FUSE_FAILING.set(1 if state == "failing" else 0))
            if self.cache_dir:
                record_holder(self.cache_dir, self.mountpoint, self.url, state, reason)

    # -- daemon ---------------------------------------------------------------------------------------------
    def run(self, daemon_argv: list[str], *, env: dict | None = None, first: EarlyChild | None = None) -> int:
        """Start the daemon and restart it until the file system is unmounted; returns the last exit code.
        If the very first daemon cannot serve, the mount is taken down again and its exit code returned.
        ``first``: the first daemon, already started (it attaches now)."""
        delay = self.restart_delay
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, lambda *_: self.stop())
            except ValueError:  # not the main thread: the caller handles signals
                break
        rc = 0
        down_since = time.monotonic()
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                self.generation += 1
                if self.generation > 1:
                    metrics.safely(metrics.FUSE_RESTARTS.inc)
                self._ready.clear()
                if self.keeper and self.generation > 1:  # (the keeper's copy names the generation to resume)
                    with contextlib.suppress(CacheFSError):
                        self._deposit()
                if first is not None:  # (started while this process checked or took over; it attaches now)
                    self.daemon, first = first.go(self.adopted_env), None
                else:
                    self.daemon = subprocess.Popen(daemon_argv, env=env)
                rc = self._wait_daemon(down_since)
                served = self._ready.is_set()
                if rc == 0 or self._stopping.is_set() or not is_fuse_mount(self.mountpoint):
                    break
                if not self._served:  # never served: a mount that cannot work is not left behind
                    log.error("%s: the FUSE daemon could not start (%s); unmounting", self.mountpoint, _describe(rc))
                    self.stop()
                    break
                now = time.monotonic()
                if served:
                    down_since = now
                    if now - started > 30:
                        delay = self.restart_delay  # it ran for a while: a fresh failure, not a crash loop
                    log.warning("%s: FUSE daemon exited (%s); restarting it in %.1f s (readers wait meanwhile)",
                                self.mountpoint, _describe(rc), delay)
                    limit = self.max_restart_delay
                else:
                    self._fail_open(down_since)
                    log.warning("%s: FUSE daemon could not start (%s: %s); trying again in %.1f s", self.mountpoint,
                                _describe(rc), self.reason or "see above", delay)
                    limit = self.max_failing_delay
                if self._stopping.wait(delay):
                    break
                delay = min(delay * 2, limit)
        finally:
            self.close()
        return rc

    def _wait_daemon(self, down_since: float) -> int:
        """Wait for the daemon to exit; meanwhile start answering requests once the mount has gone unserved
        for ``answer_after`` seconds."""
        daemon = self.daemon
        assert daemon is not None, "a daemon was started"
        while True:
            try:
                return daemon.wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                if not self._ready.is_set():
                    self._fail_open(down_since)

    def _fail_open(self, down_since: float) -> None:
        """Answer the kernel's requests here (with errors) if the mount was served once and no daemon has
        served it for ``answer_after`` seconds."""
        with self._responder_lock:
            responder = self.responder
            if responder is None or self._ready.is_set() or not self._served or responder.running \
                    or time.monotonic() - down_since < self.answer_after:
                return
            log.error("%s: no FUSE daemon for %.0f s; answering requests with errors until one starts",
                      self.mountpoint, time.monotonic() - down_since)
            responder.start()
        self._set_state("failing", self.reason or "the FUSE daemon cannot start (see the mount's log)")

    def stop(self) -> None:
        """Unmount and let the daemon finish (it sees the unmount and exits)."""
        self._stopping.set()
        if self.keeper:  # (its copy would keep nothing alive once unmounted, but say so at once)
            from cachefs.fuse.keeper import drop_session

            with contextlib.suppress(CacheFSError):
                drop_session(self.keeper, self.mountpoint)
        try:
            unmount(self.mountpoint)
        except CacheFSError as exc:
            log.warning("%s", exc)
        d = self.daemon
        if d is not None and d.poll() is None:
            threading.Timer(10.0, _kill, args=(d,)).start()

    def close(self) -> None:
        self._stopping.set()
        if self.responder is not None:
            self.responder.stop()
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
        if self.cache_dir:
            forget_holder(self.cache_dir, self.mountpoint)


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

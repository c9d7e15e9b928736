"""A second holder for every FUSE session's descriptor, in another process, so that a session outlives its holder.

A mount stays connected while any process holds its ``/dev/fuse`` descriptor (:mod:`.holder`). Holders live in the
node pod's mounter container; when that container dies (``kill -9``, OOM, a crash) every holder and daemon in it
dies with it, and without a second copy every pod reading the node's sessions would see "Transport endpoint is not
connected". So each holder also deposits a copy of its descriptor, with what it takes to start it again (its command
line, the volume's credentials, the daemon generation), with a :class:`SessionKeeper` that runs in another container
(the CSI plugin's). While the keeper holds the copy, the kernel queues the mount's requests (readers wait); the
restarted mounter asks the keeper for the sessions whose holders are gone and starts a holder for each on the kept
descriptor (``cachefs mount … --adopt``), whose daemon replays the mount journal and asks the kernel to resend what
the dead one had read.

The keeper forgets a session when its mount goes away (the descriptor reports an error once unmounted) or its
holder says so. If the keeper's process restarts, holders deposit their copies again (they check every few
seconds). Credentials stay in memory, never on disk. The socket is root's alone (0600): it hands out whole file
systems.

Protocol, one connection per request: a JSON line, the descriptor attached (``SCM_RIGHTS``) where one goes along.
``{"op": "keep", "mountpoint", "meta", "env"}`` + fd → ``{"ok": true}``; ``{"op": "list"}`` →
``{"sessions": [{"mountpoint", "meta"}]}``; ``{"op": "take", "mountpoint"}`` → ``{"meta", "env"}`` + a copy of the
fd (the keeper keeps its own); ``{"op": "has", "mountpoint", "pid"}`` → ``{"kept": bool}`` (kept for that holder
pid); ``{"op": "drop", "mountpoint"}`` → ``{"ok": true}``; errors → ``{"error": message}``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import socketserver
import threading
from dataclasses import dataclass, field

from cachefs.base.errors import CacheFSError

__all__ = ["HANDOVER_VERSION", "KEEPER_ENV", "PREDECESSOR_ENV", "SessionKeeper", "drop_session", "has_session",
           "keep_session", "kept_sessions", "take_session"]

log = logging.getLogger("cachefs.fuse")

#: The session keeper's socket, set in the environment of holders that should keep a second copy of their
#: descriptor (the CSI mounter sets it).
KEEPER_ENV = "CACHEFS_SESSION_KEEPER"
#: Set by the mounter for a holder it starts with ``--adopt`` on a session the previous node pod generation still
#: serves: that generation's keeper socket (the holder takes the descriptor there and retires the old holder).
PREDECESSOR_ENV = "CACHEFS_ADOPT_FROM"
#: The version of what a kept session's meta says (and of the holder's retire): a node pod generation takes over
#: only sessions of a version it knows, and leaves newer ones with the generation that serves them. 2: the kernel's
#: inodes are in the mount's inode table (1: in the mount journal, which this release still reads).
HANDOVER_VERSION = 2
_MAX_MESSAGE = 256 * 1024
#: Environment variables a kept session may carry (the volume's origin credentials, as the mounter passed them).
KEPT_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


@dataclass
class _Kept:
    fd: int
    meta: dict
    env: dict[str, str] = field(repr=False)


class SessionKeeper:
    """Serves the keeper socket at ``path`` from a thread (:meth:`start`, :meth:`stop`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._kept: dict[str, _Kept] = {}
        self._lock = threading.Lock()
        self._server: socketserver.UnixStreamServer | None = None
        self._stop = threading.Event()

    # -- what it holds --------------------------------------------------------------------------------------------
    def sessions(self) -> dict[str, dict]:
        with self._lock:
            return {mnt: dict(k.meta) for mnt, k in self._kept.items()}

    def _keep(self, mountpoint: str, fd: int, meta: dict, env: dict[str, str]) -> None:
        with self._lock:
            old = self._kept.pop(mountpoint, None)
            self._kept[mountpoint] = _Kept(fd, meta, env)
        if old is not None:
            os.close(old.fd)
        log.info("keeping the session of %s (holder pid %s)", mountpoint, meta.get("pid"))

    def _drop(self, mountpoint: str, why: str) -> None:
        with self._lock:
            kept = self._kept.pop(mountpoint, None)
        if kept is not None:
            os.close(kept.fd)
            log.info("forgot the session of %s (%s)", mountpoint, why)

    def _sweep(self) -> None:
        """Forget sessions whose mount is gone: an unmounted FUSE connection reports POLLERR (never POLLIN: the
        keeper must not read, or it would take requests from the daemon)."""
        while not self._stop.wait(1.0):
            with self._lock:
                fds = {k.fd: mnt for mnt, k in self._kept.items()}
            if not fds:
                continue
            poller = select.poll()
            for fd in fds:
                poller.register(fd, 0)
            for fd, events in poller.poll(0):
                if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    self._drop(fds[fd], "unmounted")

    # -- the socket ---------------------------------------------------------------------------------------------
    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        msg, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MESSAGE, 1)
        if not msg and not fds:  # a connection closed without a request: whether the keeper answers at all
            return
        reply: dict
        attach: list[int] = []
        try:
            try:
                request = json.loads(msg.split(b"\n", 1)[0] or b"null")
            except ValueError:
                raise ValueError("the request is not JSON") from None
            if not isinstance(request, dict):
                raise ValueError("the request must be a JSON object")
            op, mnt = request.get("op"), request.get("mountpoint", "")
            if op in ("keep", "take", "has", "drop") and not (isinstance(mnt, str) and mnt.startswith("/")):
                raise ValueError("mountpoint must be an absolute path")
            mnt = str(mnt)
            if op == "keep":
                if not fds:
                    raise ValueError("keep needs the descriptor")
                meta, env = request.get("meta") or {}, request.get("env") or {}
                if not isinstance(meta, dict) or not isinstance(env, dict):
                    raise ValueError("meta and env must be objects")
                self._keep(mnt, fds.pop(), meta, {k: str(v) for k, v in env.items() if k in KEPT_ENV})
                reply = {"ok": True}
            elif op == "list":
                reply = {"sessions": [{"mountpoint": m, "meta": meta} for m, meta in self.sessions().items()]}
            elif op == "take":
                with self._lock:
                    kept = self._kept.get(mnt)
                    copy = os.dup(kept.fd) if kept is not None else -1
                if kept is None:
                    raise ValueError(f"no session of {mnt} is kept")
                attach = [copy]
                reply = {"meta": kept.meta, "env": kept.env}
            elif op == "has":
                with self._lock:
                    kept = self._kept.get(mnt)
                reply = {"kept": kept is not None and kept.meta.get("pid") == request.get("pid")}
            elif op == "drop":
                self._drop(mnt, "its holder is done with it")
                reply = {"ok": True}
            else:
                raise ValueError(f"unknown op {op!r} (known: keep, list, take, has, drop)")
        except ValueError as exc:
            reply = {"error": str(exc)}
        finally:
            for fd in fds:
                os.close(fd)
        try:
            socket.send_fds(conn, [json.dumps(reply).encode() + b"\n"], attach) if attach else \
                conn.sendall(json.dumps(reply).encode() + b"\n")
        finally:
            for fd in attach:
                os.close(fd)

    def start(self) -> None:
        keeper = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    keeper._answer(self.request)
                except OSError as exc:
                    log.warning("session keeper: %s", exc)

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)  # (every generation's keeper: root only)
        if os.path.lexists(self.path):
            os.unlink(self.path)  # a previous run's
        old_umask = os.umask(0o177)
        try:
            self._server = Server(self.path, Handler)
        finally:
            os.umask(old_umask)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="cachefs-session-keeper", daemon=True).start()
        threading.Thread(target=self._sweep, name="cachefs-session-keeper-sweep", daemon=True).start()
        log.info("session keeper listening on %s", self.path)

    def stop(self) -> None:
        """Stop serving and let go of every descriptor (sessions whose holders are gone then end)."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            kept, self._kept = self._kept, {}
        for k in kept.values():
            os.close(k.fd)


def _ask(path: str, request: dict, fds: list[int] | None = None, timeout: float = 10.0) -> tuple[dict, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            data = json.dumps(request).encode() + b"\n"
            socket.send_fds(s, [data], fds) if fds else s.sendall(data)
            msg, got, _flags, _addr = socket.recv_fds(s, _MAX_MESSAGE, 1)
        except OSError as exc:
            raise CacheFSError(f"session keeper at {path}: {exc}") from None
    try:
        reply = json.loads(msg.split(b"\n", 1)[0])
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        for fd in got:
            os.close(fd)
        raise CacheFSError(f"session keeper at {path} closed the connection without an answer")
    if "error" in reply:
        for fd in got:
            os.close(fd)
        raise CacheFSError(f"session keeper at {path}: {reply['error']}")
    return reply, got


def keep_session(path: str, mountpoint: str, fd: int, meta: dict, env: dict[str, str]) -> None:
    """Deposit a copy of ``fd`` (the session of ``mountpoint``) with the keeper at ``path``."""
    _ask(path, {"op": "keep", "mountpoint": mountpoint, "meta": meta,
                "env": {k: v for k, v in env.items() if k in KEPT_ENV}}, [fd])


def kept_sessions(path: str) -> dict[str, dict]:
    """``{mountpoint: meta}`` of every session the keeper holds."""
    reply, _ = _ask(path, {"op": "list"})
    return {s["mountpoint"]: s["meta"] for s in reply.get("sessions", [])}


def take_session(path: str, mountpoint: str) -> tuple[int, dict, dict[str, str]]:
    """A copy of the kept descriptor of ``mountpoint``, with its meta and env."""
    reply, fds = _ask(path, {"op": "take", "mountpoint": mountpoint})
    if not fds:
        raise CacheFSError(f"session keeper at {path} sent no descriptor for {mountpoint}")
    return fds[0], reply.get("meta") or {}, reply.get("env") or {}


def has_session(path: str, mountpoint: str, pid: int) -> bool:
    """Whether the keeper holds the session of ``mountpoint`` as deposited by holder ``pid``."""
    reply, _ = _ask(path, {"op": "has", "mountpoint": mountpoint, "pid": pid}, timeout=5.0)
    return bool(reply.get("kept"))


def drop_session(path: str, mountpoint: str) -> None:
    _ask(path, {"op": "drop", "mountpoint": mountpoint}, timeout=5.0)

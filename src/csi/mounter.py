"""Who starts the FUSE sessions, so that they outlive the CSI plugin's container.

A FUSE session lives as long as its holder process (``cachefs mount``). If the plugin started holders itself,
they would sit in the plugin's container and a restart of that container (a crash, a liveness probe, an image
update) would kill them, and every pod using them would see "Transport endpoint is not connected". So the node
pod has a second, small container, the **mounter** (``cachefs csi-mounter``), which does nothing but start
holders when the plugin asks over a unix socket; the holders are its children, in its container, and the
plugin can restart at will. The mounter is not restarted on plugin updates (it has no logic to update).

Two implementations of one interface, :class:`Mounter`:

* :class:`LocalMounter` starts holders as its own children, in this process's container (a single-process
  setup, tests, ``cachefs csi`` without ``--mounter``). The mounter server uses it too: the one place a mount
  command is built.
* :class:`RemoteMounter` asks a mounter server over its socket.

The protocol: one JSON object per connection, one line each way. Request ``{"op": "mount", "url": …,
"mountpoint": …, "endpoint_url": …, "region": …, "group": gid or null, "mode": read bits, "env": {…}}`` or
``{"op": "ping"}``; reply ``{"ok": true}``
or ``{"error": "message"}``. The socket is root-only (0600); ``env`` carries the volume's credentials, which
are never logged. Mount points must lie under the server's ``root`` (the plugin's sessions directory).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from cachefs.base import errors as _errors
from cachefs.base.config import default_log_dir
from cachefs.base.errors import CacheFSError, ConfigError
from cachefs.fuse.holder_process import start_holder
from cachefs.fuse.keeper import KEEPER_ENV, PREDECESSOR_ENV
from cachefs.index.mounts import mount_file, record_left_behind
from cachefs.prefetch.samplers import parse_sampler
from csi.generations import answers, predecessors, takeable
from csi.publishes import sessions_in_use

__all__ = ["LocalMounter", "MountRequest", "Mounter", "MounterUnavailable", "RemoteMounter", "serve_mounter"]

log = logging.getLogger("cachefs.csi.mounter")

#: How long one mount may take (first contact with the origin, manifest load) before it counts as failed.
MOUNT_TIMEOUT = 180.0
_MAX_REQUEST = 256 * 1024


class MounterUnavailable(CacheFSError):
    """The mounter server cannot be reached (the driver answers UNAVAILABLE; kubelet retries)."""


@dataclass(frozen=True)
class MountRequest:
    url: str
    mountpoint: str
    endpoint_url: str = ""
    region: str = ""
    env: dict[str, str] = field(default_factory=dict, repr=False)  # credentials: kept out of repr and logs
    group: int | None = None  # the files' group (a pod's fsGroup); None: root's
    mode: int = 0o444  # the files' read bits
    sampler: str = ""  # the readers' declared sampler (cachefs.prefetch.samplers), "" for none
    writable: bool = False  # a checkpoint volume (cachefs mount --writable)


#: The errors a mounter's answer may name (its ``kind``), so that the plugin answers kubelet with their code.
_ERROR_KINDS: dict[str, type[CacheFSError]] = {name: getattr(_errors, name) for name in _errors.__all__
                                               if isinstance(getattr(_errors, name), type)}


class Mounter(Protocol):
    def mount(self, req: MountRequest) -> None:
        """Mount ``req.url`` read-only at ``req.mountpoint`` (held by a long-lived holder) for pods: any user the
        files' group and mode let in (allow_other); raise
        :class:`CacheFSError` with a clear message on failure."""

    def healthy(self) -> tuple[bool, str]:
        """(ok, why not) — for the plugin's Probe."""


class LocalMounter:
    """Starts holders (``cachefs mount --foreground``) as children of this process, in its container, and
    reaps them when they exit (at unmount)."""

    def __init__(self, cache_dir: str, log_dir: str | None = None, keeper: str = "") -> None:
        self.cache_dir = cache_dir
        #: The holders' logs: off the cache disk (a full cache disk would silence them).
        self.log_dir = log_dir or default_log_dir()
        #: The session keeper's socket (cachefs.fuse.keeper): holders keep a copy of their descriptor there.
        self.keeper = keeper
        self._holders: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def mount(self, req: MountRequest) -> None:
        argv = [sys.executable, "-m", "cachefs.cli.main", "mount", req.url, req.mountpoint, "--foreground",
                "--cache-dir", self.cache_dir, "--allow-other"]
        argv += ["--writable"] if req.writable else ["--mode", f"0{req.mode:o}"]
        if req.group is not None:
            argv += ["--group", str(req.group)]
        if req.sampler:
            argv += ["--sampler", req.sampler]
        if req.endpoint_url:
            argv += ["--endpoint-url", req.endpoint_url]
        if req.region:
            argv += ["--region", req.region]
        self.reap()
        self._start(argv, req.mountpoint, req.env)
        log.info("mounted %s at %s", req.url, req.mountpoint)

    def _start(self, argv: list[str], mountpoint: str, env: dict[str, str]) -> None:
        extra = {KEEPER_ENV: self.keeper} if self.keeper else {}
        holder = start_holder(argv, mountpoint, os.path.join(self.log_dir, os.path.basename(
                              mount_file(self.cache_dir, mountpoint, ".log"))), cache_dir=self.cache_dir,
                              env={**os.environ, **env, **extra}, timeout=MOUNT_TIMEOUT)
        with self._lock:
            self._holders.append(holder)

    def adopt_orphans(self, root: str) -> list[str]:
        """Start a holder for every session under ``root`` that the keeper holds and whose holder is gone (this
        mounter's container was restarted: its holders died with it, their mounts did not); returns their mount
        points. Their readers waited; the new daemons resume where the dead ones stopped."""
        from cachefs.fuse.keeper import kept_sessions

        if not self.keeper:
            return []
        adopted = []
        for mnt, meta in kept_sessions(self.keeper).items():
            if os.path.commonpath([mnt, root]) != root or answers(str(meta.get("socket") or "")):
                continue
            argv = meta.get("argv")
            if not isinstance(argv, list) or not argv:
                log.error("%s: the keeper's copy names no holder command; left as it is", mnt)
                continue
            try:  # (the new holder takes the descriptor and the volume's credentials from the keeper itself)
                self._start([*map(str, argv), "--adopt"], mnt, {})
            except CacheFSError as exc:
                log.error("%s: could not adopt the session: %s", mnt, exc)
                continue
            adopted.append(mnt)
        return adopted

    def take_over(self, root: str) -> tuple[list[str], dict[str, str]]:
        """Start a holder for every session under ``root`` that an earlier node pod generation's keeper keeps
        (:mod:`csi.generations`): each takes the session over from that generation's holder. Returns their mount
        points, and those it cannot take with why: noted for ``cachefs status`` and left to the generation serving
        them."""
        if not self.keeper:
            return [], {}
        taken: list[str] = []
        left: dict[str, str] = {}
        # Sessions pods use first: each waits only for its own hand-over, and the idle ones can wait their turn.
        in_use = sessions_in_use(os.path.dirname(root))
        for keeper, sessions in predecessors(self.keeper).items():
            ordered = sorted(sessions.items(), key=lambda s: (os.path.basename(os.path.dirname(s[0])) not in in_use,
                                                               s[0]))
            for mnt, meta in ordered:
                if os.path.commonpath([mnt, root]) != root or mnt in taken:
                    continue
                why = takeable(meta)
                if why:
                    left[mnt] = why
                    log.error("%s: not taken over: %s", mnt, why)
                    continue
                try:
                    self._start([*map(str, meta["argv"]), "--adopt"], mnt, {PREDECESSOR_ENV: keeper})
                except CacheFSError as exc:  # (the old holder serves on: it was not asked to retire, or refused)
                    left[mnt] = f"could not take it over: {exc}"
                    log.error("%s: %s", mnt, left[mnt])
                    continue
                taken.append(mnt)
        record_left_behind(self.cache_dir, left)
        return taken, left

    def wait_for_holders(self, timeout: float, poll: float = 0.5) -> bool:
        """Wait up to ``timeout`` seconds until every holder started here has exited: its mount ended, or the next
        node pod generation took it over. Whether none is left."""
        deadline = time.monotonic() + timeout
        said = -1
        while True:
            self.reap()
            left = len(self.holders)
            if not left or time.monotonic() >= deadline:
                return not left
            if left != said:
                log.warning("waiting for %d session(s) to be taken over by the next node pod or to end", left)
                said = left
            time.sleep(poll)

    @property
    def holders(self) -> list[subprocess.Popen]:
        """The holders started here that have not been reaped yet."""
        with self._lock:
            return list(self._holders)

    def reap(self) -> None:
        """Collect holders that have exited (their mounts were unmounted)."""
        with self._lock:
            self._holders = [h for h in self._holders if h.poll() is None]

    def healthy(self) -> tuple[bool, str]:
        self.reap()
        return True, ""


class RemoteMounter:
    """A mounter server on a unix socket (the node pod's ``mounter`` container)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def _call(self, request: dict, timeout: float) -> dict:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(self.socket_path)
                s.sendall(json.dumps(request).encode() + b"\n")
                with s.makefile("rb") as f:
                    line = f.readline(_MAX_REQUEST)
        except (FileNotFoundError, ConnectionRefusedError):
            raise MounterUnavailable(f"the mounter is not running (no server at {self.socket_path}; "
                               "is the node pod's mounter container up?)") from None
        except TimeoutError:
            raise MounterUnavailable(f"the mounter at {self.socket_path} did not answer within {timeout:.0f} s") from None
        except OSError as exc:
            raise MounterUnavailable(f"talking to the mounter at {self.socket_path}: {exc}") from None
        try:
            reply = json.loads(line)
        except ValueError:
            raise MounterUnavailable(f"the mounter at {self.socket_path} closed the connection without an answer") from None
        if not isinstance(reply, dict):
            raise CacheFSError(f"the mounter at {self.socket_path} answered {reply!r}")
        if "error" in reply:  # the same kind of error the mounter met (a dataset not found, refused credentials…)
            raise _ERROR_KINDS.get(str(reply.get("kind")), CacheFSError)(str(reply["error"]))
        return reply

    def mount(self, req: MountRequest) -> None:
        self._call({"op": "mount", "url": req.url, "mountpoint": req.mountpoint, "endpoint_url": req.endpoint_url,
                    "region": req.region, "group": req.group, "mode": req.mode, "sampler": req.sampler,
                    "writable": req.writable, "env": req.env},
                   timeout=MOUNT_TIMEOUT + 10)

    def healthy(self) -> tuple[bool, str]:
        try:
            self._call({"op": "ping"}, timeout=5)
        except CacheFSError as exc:
            return False, str(exc)
        return True, ""


def parse_request(raw: bytes, root: str) -> MountRequest | None:
    """The mount request in ``raw`` (``None`` for a ping); ``ValueError`` with a clear message if it is bad."""
    try:
        msg = json.loads(raw)
    except ValueError:
        raise ValueError("the request is not JSON") from None
    if not isinstance(msg, dict):
        raise ValueError("the request must be a JSON object")
    op = msg.get("op")
    if op == "ping":
        return None
    if op != "mount":
        raise ValueError(f"unknown op {op!r} (known: mount, ping)")
    strings = {k: msg.get(k, "") for k in ("url", "mountpoint", "endpoint_url", "region", "sampler")}
    if not all(isinstance(v, str) for v in strings.values()):
        raise ValueError("url, mountpoint, endpoint_url, region and sampler must be strings")
    if strings["sampler"]:
        try:
            parse_sampler(strings["sampler"])
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    env = msg.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must be an object of strings")
    group, mode = msg.get("group"), msg.get("mode", 0o444)
    if group is not None and not (type(group) is int and 0 <= group < 2**32 - 1):
        raise ValueError("group must be a group id or null")
    if not (type(mode) is int and mode & ~0o444 == 0 and mode & 0o400):
        raise ValueError("mode must be read bits (0444 at most, 0400 at least)")
    if not strings["url"] or not strings["mountpoint"]:
        raise ValueError("url and mountpoint are required")
    writable = msg.get("writable", False)
    if type(writable) is not bool:
        raise ValueError("writable must be true or false")
    mnt = os.path.realpath(strings["mountpoint"])
    if os.path.commonpath([mnt, root]) != root or mnt == root:
        raise ValueError(f"mount point {strings['mountpoint']!r} is outside {root}")
    return MountRequest(strings["url"], mnt, strings["endpoint_url"], strings["region"], env, group, mode,
                        strings["sampler"], writable)


def _take_over(local: LocalMounter, root: str, ready_file: str) -> dict[str, str]:
    """Take over what earlier node pods serve (:meth:`LocalMounter.take_over`); ``ready_file`` exists only when
    nothing was left with them. Not ready, this pod is not counted as available: a rolling update then leaves the
    earlier pod, which keeps serving what this one could not take, until those sessions end."""
    taken, left = local.take_over(root)
    if taken:
        log.warning("took over %d session(s) from the previous node pod: %s", len(taken), ", ".join(taken))
    if ready_file:
        if left:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ready_file)
        else:
            os.makedirs(os.path.dirname(ready_file) or ".", exist_ok=True)
            with open(ready_file, "w") as f:
                f.write("ready\n")
    return left


def serve_mounter(socket_path: str, root: str, cache_dir: str, *, keeper: str = "", handover_wait: float = 0.0,
                  ready_file: str = "", ready: threading.Event | None = None,
                  stop: threading.Event | None = None) -> None:
    """Serve mount requests on ``socket_path`` until ``stop`` is set (or SIGTERM in the main thread). Mounts
    go under ``root``; holders are started as children of this process and outlive the requests. With a session
    ``keeper``, holders keep a copy of their descriptor there, and the sessions a previous run of this mounter
    left (its holders died with it) are adopted first, then those an earlier node pod generation serves are taken
    over (:mod:`csi.generations`). ``ready_file`` exists while no earlier node pod serves a session this one could
    not take (the pod's readiness probe). Stopped, it waits up to ``handover_wait`` seconds for its holders to be
    taken over or to end (leaving ends the sessions they still hold)."""
    if not socket_path.startswith("/"):
        raise ConfigError(f"--socket {socket_path!r}: want an absolute path")
    root = os.path.realpath(root)
    os.makedirs(root, exist_ok=True)
    os.makedirs(os.path.dirname(socket_path), exist_ok=True)
    if os.path.exists(socket_path):
        os.unlink(socket_path)  # left by a previous run
    local = LocalMounter(cache_dir, keeper=keeper)
    try:
        adopted = local.adopt_orphans(root)
    except CacheFSError as exc:  # (no keeper yet: the plugin's container is starting too; nothing to adopt)
        log.warning("%s", exc)
        adopted = []
    if adopted:
        log.warning("adopted %d session(s) whose holders were gone: %s", len(adopted), ", ".join(adopted))
    left = _take_over(local, root, ready_file)

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            raw = self.rfile.readline(_MAX_REQUEST)
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError(f"the request must be one line of at most {_MAX_REQUEST} bytes")
                req = parse_request(raw, root)
                if req is not None:
                    local.mount(req)
                reply: dict = {"ok": True}
            except (ValueError, CacheFSError) as exc:
                log.warning("refused a request: %s", exc)
                reply = {"error": str(exc), "kind": type(exc).__name__}
            self.wfile.write(json.dumps(reply).encode() + b"\n")

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    old_umask = os.umask(0o177)  # the socket is created 0600: root only (it carries credentials)
    try:
        server = Server(socket_path, Handler)
    finally:
        os.umask(old_umask)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="cachefs-mounter",
                     daemon=True).start()
    log.info("mounter listening on %s (mounts under %s)", socket_path, root)
    if ready is not None:
        ready.set()
    while not stop.wait(5.0):
        local.reap()
        if left:  # (not ready while an earlier node pod serves sessions this one could not take: see _take_over)
            left = _take_over(local, root, ready_file)
    server.shutdown()
    server.server_close()
    # Leaving would end every session still held here (the container's processes go with it): wait until the next
    # node pod generation has taken each over, or its pods are gone and it is unmounted.
    if handover_wait > 0:
        local.wait_for_holders(handover_wait)

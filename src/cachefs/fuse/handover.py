"""The clients of a mount holder (:mod:`.holder`): the daemon's side of the hand-over (receive the mount's
``/dev/fuse`` descriptor, then say the daemon serves it from now on, or why it cannot), and the next node pod
generation's holder asking the previous one to retire."""

from __future__ import annotations

import json
import socket

from cachefs.base.errors import CacheFSError

__all__ = ["announce_failure", "announce_ready", "receive_fd", "retire_holder"]


def _ask(socket_path: str, request: dict, timeout: float) -> tuple[bytes, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(socket_path)
            s.sendall(json.dumps(request).encode() + b"\n")
            msg, fds, _flags, _addr = socket.recv_fds(s, 4096, 1)
        except OSError as exc:
            raise CacheFSError(f"no mount holder at {socket_path}: {exc}") from None
    return msg, fds


def receive_fd(socket_path: str, timeout: float = 10.0) -> tuple[int, dict]:
    """Connect to a holder and receive its ``/dev/fuse`` descriptor and the facts it sends along
    (``mountpoint``, ``generation``: how many daemons it started before this one)."""
    msg, fds = _ask(socket_path, {"op": "attach"}, timeout)
    if not fds:
        raise CacheFSError(f"mount holder at {socket_path} sent no descriptor")
    return fds[0], json.loads(msg)


def announce_ready(socket_path: str, timeout: float = 30.0) -> None:
    """Tell the holder this daemon serves the mount from now on; returns once the holder stopped answering
    requests itself (call before reading the first request)."""
    _ask(socket_path, {"op": "ready"}, timeout)


def announce_failure(socket_path: str, reason: str) -> None:
    """Tell the holder why this daemon cannot serve (``cachefs status`` shows it); best effort."""
    try:
        _ask(socket_path, {"op": "failed", "reason": reason}, 5.0)
    except CacheFSError:
        pass


def retire_holder(socket_path: str, timeout: float = 30.0) -> bool:
    """Ask the holder at ``socket_path`` to stop its daemon and let go of the mount without unmounting it (the
    caller holds a copy of the descriptor and serves the mount next); returns once it has, False if no holder
    answers there (it is gone already)."""
    try:
        msg, _ = _ask(socket_path, {"op": "retire"}, timeout)
    except CacheFSError:
        return False
    reply = json.loads(msg or b"null")
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise CacheFSError(f"mount holder at {socket_path} would not retire: {msg[:200]!r}")
    return True

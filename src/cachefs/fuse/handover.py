"""The daemon's side of the hand-over with its mount holder (:mod:`.holder`): receive the mount's ``/dev/fuse``
descriptor, then say the daemon serves it from now on, or why it cannot."""

from __future__ import annotations

import json
import socket

from cachefs.base.errors import CacheFSError

__all__ = ["announce_failure", "announce_ready", "receive_fd"]


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

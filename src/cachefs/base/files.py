"""Crash-safe file replacement: the one way cachefs rewrites a small state file (records, journals, tables)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["atomic_write", "try_lock"]


def atomic_write(path: str, data: bytes | str | Callable[[BinaryIO], object], *, fsync: bool = False,
                 mode: int = 0o600, dir_mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` (bytes, text as UTF-8, or a function that writes to the open file): written to
    a temp file in the same directory, then renamed over ``path``, so that a crash at any instant leaves the old
    file or the new one, never a torn one. With ``fsync``, the file and its directory entry are on disk before this
    returns (it survives a power loss too: for state that outlives the node's processes). With ``dir_mode``, the
    directory is made first if missing. On failure the temp file is removed and the OSError raised."""
    folder = os.path.dirname(path) or "."
    if dir_mode is not None:
        os.makedirs(folder, mode=dir_mode, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode), "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def try_lock(path: str) -> int | None:
    """An exclusive ``flock`` on ``path`` (made if need be), held until its descriptor is closed: the descriptor,
    or None if a live process holds it (in any pid namespace: the lock is the file's)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd

"""Where a mount's hand-over socket goes: beside its other records in the cache directory, or, when that path is
longer than a unix socket's may be, in this user's private runtime directory."""

from __future__ import annotations

import hashlib
import os
import stat

from cachefs.base.errors import ConfigError

__all__ = ["SUN_PATH_MAX", "runtime_dir", "socket_path_for"]

#: Longest unix socket path the kernel takes (sun_path is 108 bytes with its NUL).
SUN_PATH_MAX = 107


def socket_path_for(path: str) -> str:
    """``path`` for a unix socket, or, when it is too long to bind (108 bytes), a short name derived from it in
    this user's runtime directory (:func:`runtime_dir`)."""
    if len(path.encode()) > SUN_PATH_MAX:
        path = os.path.join(runtime_dir(), f"{hashlib.blake2b(path.encode(), digest_size=8).hexdigest()}.sock")
    return path


def runtime_dir() -> str:
    """A directory only this user can enter, for sockets: ``sockets`` under ``/run/cachefs`` for root, under
    ``$XDG_RUNTIME_DIR/cachefs`` otherwise, else ``/tmp/cachefs-<uid>``; made (0700) if missing, refused if it is
    someone else's or others may enter it. (The parent is shared with the metrics directory and the CSI mounter's
    socket, so it may be 0755; this leaf never is.)"""
    if os.geteuid() == 0:
        base = "/run/cachefs"
    elif os.environ.get("XDG_RUNTIME_DIR"):
        base = os.path.join(os.environ["XDG_RUNTIME_DIR"], "cachefs")
    else:
        base = f"/tmp/cachefs-{os.geteuid()}"
    path = os.path.join(base, "sockets")
    os.makedirs(path, mode=0o700, exist_ok=True)
    for part, private in ((base, False), (path, True)):
        st = os.lstat(part)
        bad_mode = st.st_mode & (0o077 if private else 0o022)
        if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode) or bad_mode:
            raise ConfigError(f"{part}: not a {'private ' if private else ''}directory of this user (owner uid "
                              f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); cannot put the mount's socket "
                              "there")
    return path

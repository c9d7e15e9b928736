"""Mounting and unmounting a FUSE file system on a ``/dev/fuse`` descriptor, and finding stale mounts.

As root we call mount(2) ourselves with ``fd=N``. Unprivileged mounting (``fusermount3``) is not supported
yet: :func:`mount_fuse` says so with a clear error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from ..errors import CacheFSError

__all__ = ["is_fuse_mount", "is_stale_mount", "mount_fuse", "open_fuse_device", "unmount"]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def open_fuse_device() -> int:
    try:
        return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise CacheFSError(f"cannot open /dev/fuse: {exc.strerror} (is the fuse module loaded, and the device "
                           "passed into this container?)", errno_=exc.errno) from None


def mount_fuse(fd: int, mountpoint: str, *, fsname: str = "cachefs", allow_other: bool = True) -> None:
    """Mount the session on ``fd`` at ``mountpoint``, read-only, nosuid, nodev."""
    if os.geteuid() != 0:
        raise CacheFSError("mounting needs root (CAP_SYS_ADMIN); unprivileged mounts via fusermount3 are not "
                           "supported yet", errno_=errno.EPERM)
    st = os.stat(mountpoint)
    opts = f"fd={fd},rootmode={st.st_mode & 0o170000:o},user_id=0,group_id=0,default_permissions"
    if allow_other:
        opts += ",allow_other"
    rc = _libc.mount(fsname.encode(), mountpoint.encode(), b"fuse.cachefs", MS_RDONLY | MS_NOSUID | MS_NODEV,
                     opts.encode())
    if rc != 0:
        e = ctypes.get_errno()
        raise CacheFSError(f"mount {mountpoint}: {os.strerror(e)}", errno_=e)


def unmount(mountpoint: str, *, lazy: bool = True) -> None:
    rc = _libc.umount2(mountpoint.encode(), MNT_DETACH if lazy else 0)
    if rc != 0:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point (already gone)
            raise CacheFSError(f"umount {mountpoint}: {os.strerror(e)}", errno_=e)


def is_stale_mount(mountpoint: str) -> bool:
    """A FUSE mount whose daemon is gone: any access fails with ENOTCONN (or ECONNABORTED). STATFS is
    asked, because the kernel answers it from no cache (a cached ``stat`` can succeed on a dead mount)."""
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def is_fuse_mount(path: str) -> bool:
    """Whether ``path`` is a cachefs FUSE mount point (in this mount namespace)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path and " - fuse.cachefs " in line:
                return True
    return False

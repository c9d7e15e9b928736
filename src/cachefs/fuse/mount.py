"""Mounting and unmounting a FUSE file system on a ``/dev/fuse`` descriptor, and finding stale mounts.

As root we open ``/dev/fuse`` and call mount(2) ourselves with ``fd=N``. Without root, the setuid helper
``fusermount3`` (Debian package fuse3) mounts for us and passes the descriptor back over a socket pair
(``_FUSE_COMMFD``, ``SCM_RIGHTS``); such mounts are served in userspace mode (passthrough needs
CAP_SYS_ADMIN) and ``allow_other`` needs ``user_allow_other`` in ``/etc/fuse.conf``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import socket
import subprocess
import threading

from cachefs.base.errors import CacheFSError

__all__ = ["bind_mount", "is_fuse_mount", "is_mount_point", "is_stale_mount", "mount_fuse", "open_and_mount",
           "open_fuse_device", "other_mounts_of", "probe_mount", "set_read_ahead", "unmount"]

log = logging.getLogger("cachefs.fuse")

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


def open_and_mount(mountpoint: str, *, allow_other: bool = False, writable: bool = False) -> int:
    """Mount a new FUSE file system at ``mountpoint`` (read-only unless ``writable``; nosuid, nodev) and return its
    ``/dev/fuse`` descriptor: by mount(2) as root, through ``fusermount3`` otherwise."""
    if os.geteuid() != 0:
        return _fusermount(mountpoint, allow_other=allow_other, writable=writable)
    fd = open_fuse_device()
    try:
        mount_fuse(fd, mountpoint, allow_other=allow_other, writable=writable)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fusermount(mountpoint: str, *, allow_other: bool, writable: bool = False) -> int:
    helper = shutil.which("fusermount3")
    if helper is None:
        raise CacheFSError("mounting without root needs fusermount3 (Debian package fuse3), or run as root",
                           errno_=errno.EPERM)
    if allow_other and not _user_allow_other():
        log.warning("mounting without allow_other: /etc/fuse.conf lacks user_allow_other, so only this user "
                    "can read the mount")
        allow_other = False
    opts = ("rw" if writable else "ro") + ",nosuid,nodev,default_permissions,fsname=cachefs,subtype=cachefs" + \
        (",allow_other" if allow_other else "")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        proc = subprocess.run([helper, "-o", opts, "--", mountpoint], env={**os.environ,
                              "_FUSE_COMMFD": str(theirs.fileno())}, pass_fds=[theirs.fileno()],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise CacheFSError(f"fusermount3 could not mount {mountpoint}: "
                               f"{proc.stderr.strip() or f'exit code {proc.returncode}'}", errno_=errno.EPERM)
        ours.settimeout(10)
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 16, 1)
    if not fds:
        raise CacheFSError(f"fusermount3 mounted {mountpoint} but passed no descriptor")
    os.set_inheritable(fds[0], False)
    return fds[0]


def _user_allow_other() -> bool:
    try:
        with open("/etc/fuse.conf") as f:
            return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def mount_fuse(fd: int, mountpoint: str, *, fsname: str = "cachefs", allow_other: bool = False,
               writable: bool = False) -> None:
    """Mount the session on ``fd`` at ``mountpoint``, read-only unless ``writable``, nosuid, nodev (needs root)."""
    st = os.stat(mountpoint)
    opts = f"fd={fd},rootmode={st.st_mode & 0o170000:o},user_id=0,group_id=0,default_permissions"
    if allow_other:
        opts += ",allow_other"
    flags = MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY)
    rc = _libc.mount(fsname.encode(), mountpoint.encode(), b"fuse.cachefs", flags, opts.encode())
    if rc != 0:
        e = ctypes.get_errno()
        raise CacheFSError(f"mount {mountpoint}: {os.strerror(e)}", errno_=e)


MS_REMOUNT = 32
MS_BIND = 4096


def bind_mount(source: str, target: str, *, readonly: bool = True) -> None:
    """Bind ``source`` at ``target`` (root), read-only unless asked otherwise."""
    if _libc.mount(source.encode(), target.encode(), None, MS_BIND, None) != 0:
        e = ctypes.get_errno()
        raise CacheFSError(f"bind mount {source} at {target}: {os.strerror(e)}", errno_=e)
    if readonly and _libc.mount(b"none", target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
                                None) != 0:
        e = ctypes.get_errno()
        _libc.umount2(target.encode(), MNT_DETACH)
        raise CacheFSError(f"making {target} read-only: {os.strerror(e)}", errno_=e)


def _mountinfo() -> list[tuple[str, str, str]]:
    """(mount point, device "major:minor", file system type) of every mount in this mount namespace, from
    /proc/self/mountinfo (mount point is field 5; the type follows the " - " separator)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            out.append((fields[4], fields[2], line.split(" - ", 1)[1].split()[0]))
    return out


def _mounts_at(path: str) -> list[tuple[str, str]]:
    """(device, file system type) of every mount at ``path``."""
    return [(dev, fstype) for mnt, dev, fstype in _mountinfo() if mnt == path]


def other_mounts_of(path: str) -> list[str]:
    """Mount points other than ``path`` that show the file system mounted at ``path`` (its bind mounts)."""
    devices = {dev for dev, _ in _mounts_at(path)}
    return [mnt for mnt, dev, _ in _mountinfo() if dev in devices and mnt != path]


def is_mount_point(path: str) -> bool:
    """Whether something is mounted at ``path`` (in this mount namespace)."""
    return bool(_mounts_at(path))


def unmount(mountpoint: str, *, lazy: bool = True) -> None:
    if os.geteuid() != 0 and shutil.which("fusermount3"):
        proc = subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), "--", mountpoint],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0 and "not mounted" not in proc.stderr and "not found" not in proc.stderr:
            raise CacheFSError(f"fusermount3 -u {mountpoint}: {proc.stderr.strip()}")
        return
    rc = _libc.umount2(mountpoint.encode(), MNT_DETACH if lazy else 0)
    if rc != 0:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point (already gone)
            raise CacheFSError(f"umount {mountpoint}: {os.strerror(e)}", errno_=e)


def probe_mount(mountpoint: str, timeout: float = 2.0) -> str:
    """How a mount answers STATFS (the kernel asks the daemon; a cached ``stat`` can succeed on a dead mount):
    ``serving``; ``stale`` (ENOTCONN or ECONNABORTED: no daemon, or a holder answering for a daemon that
    cannot start); ``hung`` (no answer within ``timeout``). Never waits longer than that: the asking thread
    is left behind (it ends when the request is answered or the process exits)."""
    result: list[str] = []

    def ask() -> None:
        try:
            os.statvfs(mountpoint)
            result.append("serving")
        except OSError as exc:
            result.append("stale" if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED) else "serving")

    t = threading.Thread(target=ask, name="cachefs-statfs-probe", daemon=True)
    t.start()
    t.join(timeout)
    return result[0] if result else "hung"


def is_stale_mount(mountpoint: str) -> bool:
    """A FUSE mount that no daemon serves: STATFS fails with ENOTCONN (see :func:`probe_mount`)."""
    return probe_mount(mountpoint) == "stale"


def set_read_ahead(mountpoint: str, kib: int) -> bool:
    """Let the kernel read ahead ``kib`` KiB on this mount (its default, 128 KiB, caps userspace READs at 128
    KiB; 1 MiB requests cost a fifth less CPU per byte). Root only; False if it could not be set."""
    mounts = _mounts_at(mountpoint)
    if not mounts:
        return False
    dev = mounts[-1][0]  # the top one
    try:
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(f"{kib}\n")
        return True
    except OSError:
        return False


def is_fuse_mount(path: str) -> bool:
    """Whether ``path`` is a cachefs FUSE mount point (in this mount namespace)."""
    return any(fstype == "fuse.cachefs" for _, fstype in _mounts_at(path))

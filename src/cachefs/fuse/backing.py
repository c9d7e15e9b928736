"""Passthrough's backing files: the ``/dev/fuse`` ioctls that register a cache file with the kernel (which then
reads it without asking the daemon) and let go of it."""

from __future__ import annotations

import fcntl

from cachefs.fuse import kernel_abi as abi

__all__ = ["DeviceBacking"]


class DeviceBacking:
    """The backing-file ioctls of the mounted ``/dev/fuse`` descriptor ``fd`` (a :class:`~.fs.BackingFiles`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def open(self, fd: int) -> int:
        arg = bytearray(abi.BACKING_MAP.pack(fd, 0, 0))
        return fcntl.ioctl(self.fd, abi.FUSE_DEV_IOC_BACKING_OPEN, arg, True)

    def close(self, backing_id: int) -> None:
        arg = bytearray(backing_id.to_bytes(4, "little"))
        fcntl.ioctl(self.fd, abi.FUSE_DEV_IOC_BACKING_CLOSE, arg, True)

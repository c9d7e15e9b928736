"""The writable checkpoint volume on FUSE: the kernel protocol of a volume mount, a sibling of the read-only dataset
mount (:mod:`.session`) over the same request loop (:mod:`.request_loop`).

Each handler unpacks its request, asks the volume's file system (:mod:`.volume_fs`) and packs the answer. Requests
that may wait (OPEN may download the file, WRITE may wait for room, FLUSH, FSYNC and RELEASE fsync and queue,
committing writes the journal) are :class:`~.request_loop.Call`s, answered once the device is handed to another
thread.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable

from cachefs.fuse import kernel_abi as abi
from cachefs.fuse.kernel_abi import InitFlag, Op
from cachefs.fuse.request_loop import UNIQUE_RESEND, Call, RequestLoop
from cachefs.fuse.volume_fs import AttrChange, VolumeFS
from cachefs.write.volume import WritableVolume

__all__ = ["COMMIT_XATTR", "WritableSession"]

log = logging.getLogger("cachefs.fuse")

#: Set on a directory (any value) to commit it as a checkpoint: ``cachefs sync --commit DIR`` does.
COMMIT_XATTR = b"user.cachefs.commit"
#: Seconds the kernel may keep names and attributes: only this daemon changes the tree.
VALID = 1.0


def _name(body: memoryview | bytes) -> str:
    return bytes(body).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _attr(nodeid: int, st: os.stat_result) -> bytes:
    # A queued snapshot is a second link to a file: not the user's, so files show one link.
    nlink = st.st_nlink if stat.S_ISDIR(st.st_mode) else 1
    return abi.pack_attr(nodeid, st.st_size, st.st_mode, st.st_mtime_ns, nlink, st.st_uid, st.st_gid)


def _entry(nodeid: int, st: os.stat_result) -> bytes:
    return abi.pack_entry(nodeid, _attr(nodeid, st), VALID, VALID)


def _empty_after(work: Callable[..., None], *args: int) -> bytes:
    work(*args)
    return b""


def _attr_change(valid: int, size: int, mode: int, uid: int, gid: int, atime: int, atime_ns: int, mtime: int,
                 mtime_ns: int) -> AttrChange:
    now = time.time_ns()
    return AttrChange(
        size=size if valid & abi.FATTR_SIZE else None,
        mode=mode if valid & abi.FATTR_MODE else None,
        uid=uid if valid & abi.FATTR_UID else None,
        gid=gid if valid & abi.FATTR_GID else None,
        atime_ns=now if valid & abi.FATTR_ATIME_NOW else (atime * 10**9 + atime_ns if valid & abi.FATTR_ATIME
                                                          else None),
        mtime_ns=now if valid & abi.FATTR_MTIME_NOW else (mtime * 10**9 + mtime_ns if valid & abi.FATTR_MTIME
                                                          else None))


class WritableSession(RequestLoop):
    """Serves ``volume`` on the mounted ``/dev/fuse`` descriptor ``fd``."""

    def __init__(self, volume: WritableVolume, fd: int, *, workers: int = 4, generation: int = 0,
                 on_init: Callable[[WritableSession], None] | None = None) -> None:
        super().__init__(fd, workers=workers, timeout=VALID, on_init=on_init)
        self.volume = volume
        self.fs = VolumeFS(volume, generation=generation)
        self.ops.update({
            Op.LOOKUP: self._lookup, Op.GETATTR: self._getattr, Op.SETATTR: self._setattr, Op.OPEN: self._open,
            Op.CREATE: self._create, Op.READ: self._read, Op.WRITE: self._write, Op.FLUSH: self._flush,
            Op.FSYNC: self._fsync, Op.RELEASE: self._release, Op.MKDIR: self._mkdir, Op.MKNOD: self._mknod,
            Op.UNLINK: self._unlink, Op.RMDIR: self._rmdir, Op.RENAME: self._rename, Op.RENAME2: self._rename2,
            Op.LINK: self._refuse_link, Op.SYMLINK: self._refuse_link, Op.READLINK: self._readlink,
            Op.OPENDIR: self._opendir, Op.READDIR: self._readdir, Op.RELEASEDIR: self._releasedir,
            Op.FSYNCDIR: self._empty, Op.STATFS: self._statfs, Op.ACCESS: self._access, Op.GETXATTR: self._getxattr,
            Op.LISTXATTR: self._listxattr, Op.SETXATTR: self._setxattr, Op.REMOVEXATTR: self._no_xattr,
            Op.FALLOCATE: self._fallocate,
        })

    # -- INIT and take-over -------------------------------------------------------------------------------------
    def init_wants(self) -> int:
        return int(InitFlag.ASYNC_READ | InitFlag.BIG_WRITES | InitFlag.PARALLEL_DIROPS | InitFlag.MAX_PAGES
                   | InitFlag.ATOMIC_O_TRUNC | InitFlag.INIT_EXT)

    def initialized(self, agreed: int) -> int:
        self.mode = "writable"
        return 0

    def restored(self) -> bool:
        self.mode = "writable"  # (the tree is the state: node ids are found again in it)
        return True

    # -- handlers -------------------------------------------------------------------------------------------------
    def _empty(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return b""

    def _lookup(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return _entry(*self.fs.lookup(nodeid, _name(body)))

    def _getattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        flags, _, fh = abi.GETATTR_IN.unpack_from(body)
        st = self.fs.getattr(nodeid, fh if flags & 1 else None)  # FUSE_GETATTR_FH: the open file
        return abi.pack_attr_out(_attr(nodeid, st), VALID)

    def _setattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        (valid, _, fh, size, _lo, atime, mtime, _c, atime_ns, mtime_ns, _cn, mode, _u4, uid, gid,
         _u5) = abi.SETATTR_IN.unpack_from(body)
        change = _attr_change(valid, size, mode, uid, gid, atime, atime_ns, mtime, mtime_ns)
        st = self.fs.setattr(nodeid, fh if valid & abi.FATTR_FH else None, change)
        return abi.pack_attr_out(_attr(nodeid, st), VALID)

    def _open(self, nodeid: int, unique: int, body: memoryview) -> Call:
        flags, _ = abi.OPEN_IN.unpack_from(body)
        return Call(unique, Op.OPEN, lambda: abi.OPEN_OUT.pack(self.fs.open(nodeid, flags), 0, 0), nodeid)

    def _create(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        flags, mode, umask, _ = abi.CREATE_IN.unpack_from(body)
        child, st, fh = self.fs.create(nodeid, _name(body[abi.CREATE_IN.size:]), flags, stat.S_IMODE(mode) & ~umask)
        return _entry(child, st) + abi.OPEN_OUT.pack(fh, 0, 0)

    def _read(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        return self.fs.read(nodeid, fh, offset, size)

    def _write(self, nodeid: int, unique: int, body: memoryview) -> Call:
        fh, offset, size = abi.WRITE_IN.unpack_from(body)[:3]
        data = bytes(body[abi.WRITE_IN.size:abi.WRITE_IN.size + size])  # (the request buffer is reused)
        return Call(unique, Op.WRITE, lambda: abi.WRITE_OUT.pack(self.fs.write(nodeid, fh, offset, data), 0), nodeid)

    def _flush(self, nodeid: int, unique: int, body: memoryview) -> Call:
        fh = abi.FLUSH_IN.unpack_from(body)[0]
        return Call(unique, Op.FLUSH, functools.partial(_empty_after, self.fs.sync, nodeid, fh), nodeid)

    def _fsync(self, nodeid: int, unique: int, body: memoryview) -> Call:
        fh = abi.FSYNC_IN.unpack_from(body)[0]
        return Call(unique, Op.FSYNC, functools.partial(_empty_after, self.fs.sync, nodeid, fh), nodeid)

    def _release(self, nodeid: int, unique: int, body: memoryview) -> Call:
        fh = abi.RELEASE_IN.unpack_from(body)[0]
        return Call(unique, Op.RELEASE, functools.partial(_empty_after, self.fs.release, nodeid, fh), nodeid)

    def _mkdir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        mode, umask = abi.MKDIR_IN.unpack_from(body)
        return _entry(*self.fs.mkdir(nodeid, _name(body[abi.MKDIR_IN.size:]), stat.S_IMODE(mode) & ~umask,
                                     resent=_resent(unique)))

    def _mknod(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        mode, _rdev, umask, _ = abi.MKNOD_IN.unpack_from(body)
        return _entry(*self.fs.mknod(nodeid, _name(body[abi.MKNOD_IN.size:]), mode & ~umask))

    def _unlink(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self.fs.unlink(nodeid, _name(body), resent=_resent(unique))
        return b""

    def _rmdir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self.fs.rmdir(nodeid, _name(body), resent=_resent(unique))
        return b""

    def _rename(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        (newdir,) = abi.RENAME_IN.unpack_from(body)
        return self._rename_names(nodeid, newdir, bytes(body[abi.RENAME_IN.size:]), 0, _resent(unique))

    def _rename2(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        newdir, flags, _ = abi.RENAME2_IN.unpack_from(body)
        return self._rename_names(nodeid, newdir, bytes(body[abi.RENAME2_IN.size:]), flags, _resent(unique))

    def _rename_names(self, olddir: int, newdir: int, names: bytes, flags: int, resent: bool) -> bytes:
        if flags & ~abi.RENAME_NOREPLACE:
            raise OSError(errno.EINVAL, "only RENAME_NOREPLACE is supported (no RENAME_EXCHANGE or WHITEOUT)")
        old, new = names.split(b"\0")[:2]
        self.fs.rename(olddir, _name(old), newdir, _name(new), noreplace=bool(flags & abi.RENAME_NOREPLACE),
                       resent=resent)
        return b""

    def _refuse_link(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        raise OSError(errno.EPERM, "a checkpoint volume has no hard links or symlinks (objects cannot share bytes)")

    def _readlink(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        raise OSError(errno.EINVAL, "not a symlink")

    def _opendir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return abi.OPEN_OUT.pack(self.fs.opendir(nodeid), 0, 0)

    def _readdir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        entries = self.fs.listdir(nodeid, fh)
        out = bytearray()
        for i in range(offset, len(entries) + 2):
            name, is_dir = entries[i - 2] if i >= 2 else ("." * (i + 1), True)
            raw = name.encode("utf-8", "surrogateescape")
            if len(out) + abi.dirent_size(raw) > size:
                break
            out += abi.pack_dirent(0xFFFFFFFF if i >= 2 else nodeid, i + 1, raw, abi.DT_DIR if is_dir else abi.DT_REG)
        return bytes(out)

    def _releasedir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self.fs.releasedir(abi.RELEASE_IN.unpack_from(body)[0])
        return b""

    def _statfs(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        st = self.fs.statfs()
        return abi.KSTATFS.pack(st.f_blocks, st.f_bfree, st.f_bavail, st.f_files, st.f_ffree, st.f_bsize, 255,
                                st.f_frsize)

    def _access(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self.fs.access(nodeid)
        return b""

    def _getxattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        raise OSError(errno.ENODATA, "no such attribute")

    def _listxattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        size, _ = abi.GETXATTR_IN.unpack_from(body)
        return abi.GETXATTR_OUT.pack(0, 0) if size == 0 else b""

    def _setxattr(self, nodeid: int, unique: int, body: memoryview) -> Call:
        if bytes(body[abi.SETXATTR_IN.size:]).split(b"\0", 1)[0] != COMMIT_XATTR:
            raise OSError(errno.ENOTSUP, "extended attributes are not kept")
        return Call(unique, Op.SETXATTR, functools.partial(_empty_after, self.fs.commit, nodeid), nodeid)

    def _no_xattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        raise OSError(errno.ENOTSUP, "extended attributes are not kept")

    def _fallocate(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh, offset, length, mode, _ = abi.FALLOCATE_IN.unpack_from(body)
        if mode:
            raise OSError(errno.EOPNOTSUPP, "only plain fallocate is supported")
        self.fs.fallocate(nodeid, fh, offset, length)
        return b""


def _resent(unique: int) -> bool:
    """The kernel sent this request again after a daemon died (FUSE_NOTIFY_RESEND): it may have been done."""
    return bool(unique & UNIQUE_RESEND)

"""The writable checkpoint volume on FUSE: a sibling of the read-only dataset mount (:mod:`.session`), sharing only
the request loop (:mod:`.request_loop`).

Every request maps onto the volume's tree on the node's disk (:class:`~cachefs.write.volume.WritableVolume`):
node ids are the tree's inode numbers (the root is 1), so they survive renames and a restarted daemon finds them
again by walking the tree. Writes go to the tree file at disk speed; FLUSH (every ``close``) and FSYNC return once
the file is durable here and queued for the origin; RENAME, UNLINK and a ``user.cachefs.commit`` xattr on a
directory tell the volume what the origin must see. Hard links and symlinks are refused with EPERM.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from cachefs.fuse import kernel_abi as abi
from cachefs.fuse.errno_map import to_errno
from cachefs.fuse.kernel_abi import InitFlag, Op
from cachefs.fuse.order_channel import CALLER
from cachefs.fuse.request_loop import Later, RequestLoop
from cachefs.write.volume import WritableVolume

__all__ = ["COMMIT_XATTR", "WritableSession"]

log = logging.getLogger("cachefs.fuse")

ROOT = 1
#: Set on a directory (any value) to commit it as a checkpoint: ``cachefs sync --commit DIR`` does.
COMMIT_XATTR = b"user.cachefs.commit"
#: Seconds the kernel may keep names and attributes: only this daemon changes the tree.
VALID = 1.0


class _Handle:
    __slots__ = ("fd", "inode", "nodeid", "writable", "wrote")

    def __init__(self, fd: int, nodeid: int, writable: bool) -> None:
        self.fd, self.nodeid, self.writable = fd, nodeid, writable
        self.inode = os.fstat(fd).st_ino
        self.wrote = False


class WritableSession(RequestLoop):
    """Serves ``volume`` on the mounted ``/dev/fuse`` descriptor ``fd``."""

    def __init__(self, volume: WritableVolume, fd: int, *, workers: int = 4, generation: int = 0) -> None:
        super().__init__(fd, workers=workers, timeout=VALID)
        self.volume = volume
        self._root_inode = os.stat(volume.tree).st_ino
        self._paths: dict[int, str] = {ROOT: ""}
        self._paths_lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._dirs: dict[int, list[tuple[str, bool]]] = {}
        self._next_fh = (generation << 40) + 1  # a restarted daemon never reuses an old one's handle numbers
        self.ops = {
            Op.INIT: self._init, Op.DESTROY: self._destroy, Op.LOOKUP: self._lookup, Op.GETATTR: self._getattr,
            Op.SETATTR: self._setattr, Op.OPEN: self._open, Op.CREATE: self._create, Op.READ: self._read,
            Op.WRITE: self._write, Op.FLUSH: self._flush, Op.FSYNC: self._fsync, Op.RELEASE: self._release,
            Op.MKDIR: self._mkdir, Op.MKNOD: self._mknod, Op.UNLINK: self._unlink, Op.RMDIR: self._rmdir,
            Op.RENAME: self._rename, Op.RENAME2: self._rename2, Op.LINK: self._refuse_link,
            Op.SYMLINK: self._refuse_link, Op.READLINK: self._readlink, Op.OPENDIR: self._opendir,
            Op.READDIR: self._readdir, Op.RELEASEDIR: self._releasedir, Op.FSYNCDIR: self._empty,
            Op.STATFS: self._statfs, Op.ACCESS: self._access, Op.GETXATTR: self._getxattr,
            Op.LISTXATTR: self._listxattr, Op.SETXATTR: self._setxattr, Op.REMOVEXATTR: self._no_xattr,
            Op.FALLOCATE: self._fallocate,
        }

    # -- node ids and paths ---------------------------------------------------------------------------------------
    def _nodeid(self, inode: int, rel: str) -> int:
        nodeid = ROOT if inode == self._root_inode else inode
        with self._paths_lock:
            self._paths[nodeid] = rel
        return nodeid

    def _rel(self, nodeid: int) -> str:
        with self._paths_lock:
            rel = self._paths.get(nodeid)
        if rel is None:  # a node id a previous daemon handed out: find it in the tree
            self._learn_tree()
            with self._paths_lock:
                rel = self._paths.get(nodeid)
            if rel is None:
                raise OSError(errno.ESTALE, f"node {nodeid} is gone")
        return rel

    def _learn_tree(self) -> None:
        tree = self.volume.tree
        for dirpath, dirs, files in os.walk(tree):
            for name in (*dirs, *files):
                path = os.path.join(dirpath, name)
                try:
                    self._nodeid(os.lstat(path).st_ino, os.path.relpath(path, tree))
                except FileNotFoundError:
                    continue

    def _child(self, parent: int, body: memoryview | bytes) -> str:
        name = bytes(body).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if not name or "/" in name or name in (".", ".."):
            raise OSError(errno.EINVAL, f"bad name {name!r}")
        parent_rel = self._rel(parent)
        return f"{parent_rel}/{name}" if parent_rel else name

    def _moved(self, src: str, dst: str) -> None:
        with self._paths_lock:
            for nodeid, rel in list(self._paths.items()):
                if rel == src or rel.startswith(src + "/"):
                    self._paths[nodeid] = dst + rel[len(src):]

    def _entry(self, rel: str) -> bytes:
        st = os.lstat(self.volume.path(rel))
        nodeid = self._nodeid(st.st_ino, rel)
        return abi.pack_entry(nodeid, self._attr(nodeid, st), VALID, VALID)

    def _attr(self, nodeid: int, st: os.stat_result) -> bytes:
        # A queued snapshot is a second link to a file: not the user's, so files show one link.
        nlink = st.st_nlink if stat.S_ISDIR(st.st_mode) else 1
        return abi.pack_attr(nodeid, st.st_size, st.st_mode, st.st_mtime_ns, nlink, st.st_uid, st.st_gid)

    def _file(self, fh: int, nodeid: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:  # opened under a previous daemon: open it again
            path = self.volume.path(self._rel(nodeid))
            try:
                h = _Handle(os.open(path, os.O_RDWR | os.O_CLOEXEC), nodeid, True)
            except PermissionError:
                h = _Handle(os.open(path, os.O_RDONLY | os.O_CLOEXEC), nodeid, False)
            self._handles[fh] = h
        return h

    def _new_handle(self, h: _Handle) -> int:
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
        self._handles[fh] = h
        return fh

    def _own(self, path: str, mode: int) -> None:
        """New files and directories belong to the caller (the daemon runs as root); in a setgid directory (a
        volume published for a pod's fsGroup) to the directory's group, which the kernel gave them already. Their
        mode is ``mode``, what the caller asked for less its umask, not less the daemon's own umask too (which
        took the group's write bit from what a pod with umask 002 made in its group volume)."""
        uid, gid, _pid = CALLER.get()
        in_setgid_dir = os.stat(os.path.dirname(path)).st_mode & stat.S_ISGID
        if os.geteuid() == 0 and uid is not None:
            os.lchown(path, uid, -1 if in_setgid_dir else gid)
        if in_setgid_dir and os.path.isdir(path):
            mode |= stat.S_ISGID  # (as mkdir gave it: chmod would take it away)
        os.chmod(path, mode)

    # -- handlers ---------------------------------------------------------------------------------------------------
    def _init(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        major, minor, max_readahead, flags = abi.INIT_IN_OLD.unpack_from(body)
        if major != abi.KERNEL_VERSION:
            raise OSError(errno.EPROTO, f"kernel FUSE protocol {major}.{minor}, need 7.x")
        offered = flags
        if flags & InitFlag.INIT_EXT and len(body) >= abi.INIT_IN.size:
            offered |= abi.INIT_IN.unpack_from(body)[4] << 32
        want = (InitFlag.ASYNC_READ | InitFlag.BIG_WRITES | InitFlag.PARALLEL_DIROPS | InitFlag.MAX_PAGES
                | InitFlag.ATOMIC_O_TRUNC | InitFlag.INIT_EXT)
        agreed = int(want) & offered
        self.mode = "writable"
        log.info("FUSE %d.%d, flags 0x%x, writable volume %s", major, minor, agreed, self.volume.url)
        return abi.INIT_OUT.pack(abi.KERNEL_VERSION, abi.KERNEL_MINOR_VERSION, max_readahead, agreed & 0xFFFFFFFF,
                                 64, 48, abi.MAX_WRITE, 1, 256, 0, agreed >> 32, 0)

    def _resume(self) -> None:
        self.mode = "writable"
        try:
            os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size, abi.NOTIFY_RESEND, 0))
        except OSError as exc:
            log.warning("cannot ask the kernel to resend pending requests: %s", exc)
        if self.on_init is not None:
            self.on_init(self)

    def _destroy(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self.stopped.set()
        return b""

    def _empty(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return b""

    def _lookup(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return self._entry(self._child(nodeid, body))

    def _getattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        flags, _, fh = abi.GETATTR_IN.unpack_from(body)
        if flags & 1 and fh in self._handles:  # FUSE_GETATTR_FH: the open file, even if unlinked
            st = os.fstat(self._handles[fh].fd)
        else:
            st = os.lstat(self.volume.path(self._rel(nodeid)))
        return abi.pack_attr_out(self._attr(nodeid, st), VALID)

    def _setattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        (valid, _, fh, size, _lo, atime, mtime, _c, atime_ns, mtime_ns, _cn, mode, _u4, uid, gid,
         _u5) = abi.SETATTR_IN.unpack_from(body)
        rel = self._rel(nodeid)
        path = self.volume.path(rel)
        h = self._handles.get(fh) if valid & abi.FATTR_FH else None
        if valid & abi.FATTR_SIZE:
            if size:
                self.volume.materialize(rel)
            self.volume.before_write(os.lstat(path).st_ino, rel, 0)
            if size == 0:
                self.volume.open_for_write(rel, truncate=True)
            os.truncate(h.fd if h is not None else path, size)
        if valid & abi.FATTR_MODE:
            os.chmod(path, stat.S_IMODE(mode))
        if valid & (abi.FATTR_UID | abi.FATTR_GID):
            os.lchown(path, uid if valid & abi.FATTR_UID else -1, gid if valid & abi.FATTR_GID else -1)
        if valid & (abi.FATTR_ATIME | abi.FATTR_MTIME | abi.FATTR_ATIME_NOW | abi.FATTR_MTIME_NOW):
            st = os.lstat(path)
            now = time.time_ns()
            a = now if valid & abi.FATTR_ATIME_NOW else (atime * 10**9 + atime_ns if valid & abi.FATTR_ATIME
                                                         else st.st_atime_ns)
            m = now if valid & abi.FATTR_MTIME_NOW else (mtime * 10**9 + mtime_ns if valid & abi.FATTR_MTIME
                                                         else st.st_mtime_ns)
            os.utime(path, ns=(a, m))
        return abi.pack_attr_out(self._attr(nodeid, os.lstat(path)), VALID)

    def _open(self, nodeid: int, unique: int, body: memoryview) -> Later:
        flags, _ = abi.OPEN_IN.unpack_from(body)
        return _Call(unique, Op.OPEN, lambda: self._open_now(nodeid, flags))  # (may download the file first)

    def _open_now(self, nodeid: int, flags: int) -> bytes:
        rel = self._rel(nodeid)
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if writing:
            self.volume.open_for_write(rel, truncate=bool(flags & os.O_TRUNC))
        else:
            self.volume.materialize(rel)
        # Not O_APPEND: the kernel gives every WRITE its offset, and pwrite on an O_APPEND descriptor ignores it.
        access = flags & os.O_ACCMODE
        fd = os.open(self.volume.path(rel), access | (flags & os.O_TRUNC) | os.O_CLOEXEC)
        h = _Handle(fd, nodeid, writing)
        return abi.OPEN_OUT.pack(self._new_handle(h), 0, 0)

    def _create(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        flags, mode, umask, _ = abi.CREATE_IN.unpack_from(body)
        rel = self._child(nodeid, body[abi.CREATE_IN.size:])
        path = self.volume.path(rel)
        excl = os.O_EXCL if flags & os.O_EXCL else 0
        existed = os.path.lexists(path)
        if existed and not excl:
            self.volume.open_for_write(rel, truncate=bool(flags & os.O_TRUNC))
        wanted = stat.S_IMODE(mode) & ~umask
        fd = os.open(path, os.O_CREAT | excl | os.O_RDWR | (flags & os.O_TRUNC) | os.O_CLOEXEC, wanted)
        if not existed:
            self._own(path, wanted)
        h = _Handle(fd, 0, True)
        self.volume.before_write(h.inode, rel, 0)  # created: uploaded at close even if empty
        h.wrote = True
        entry = self._entry(rel)
        h.nodeid = abi.ENTRY_OUT_HEAD.unpack_from(entry)[0]
        return entry + abi.OPEN_OUT.pack(self._new_handle(h), 0, 0)

    def _read(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        return os.pread(self._file(fh, nodeid).fd, size, offset)

    def _write(self, nodeid: int, unique: int, body: memoryview) -> Later:
        fh, offset, size = abi.WRITE_IN.unpack_from(body)[:3]
        data = bytes(body[abi.WRITE_IN.size:abi.WRITE_IN.size + size])  # (the request buffer is reused)
        return _Call(unique, Op.WRITE, lambda: self._write_now(nodeid, fh, offset, data))

    def _write_now(self, nodeid: int, fh: int, offset: int, data: bytes) -> bytes:
        h = self._file(fh, nodeid)
        self.volume.before_write(h.inode, self._rel(nodeid), len(data))  # may wait for room
        h.wrote = True
        n = os.pwrite(h.fd, data, offset)
        return abi.WRITE_OUT.pack(n, 0)

    def _close_durably(self, nodeid: int, h: _Handle) -> None:
        if h.wrote:
            try:
                rel = self._rel(nodeid)
            except OSError:
                return  # unlinked meanwhile
            self.volume.closed(rel, h.fd)
            h.wrote = False

    def _flush(self, nodeid: int, unique: int, body: memoryview) -> Later:
        fh = abi.FLUSH_IN.unpack_from(body)[0]
        return _Call(unique, Op.FLUSH, lambda: self._sync(nodeid, fh))

    def _fsync(self, nodeid: int, unique: int, body: memoryview) -> Later:
        fh = abi.FSYNC_IN.unpack_from(body)[0]
        return _Call(unique, Op.FSYNC, lambda: self._sync(nodeid, fh))

    def _sync(self, nodeid: int, fh: int) -> bytes:
        h = self._file(fh, nodeid)
        self._close_durably(nodeid, h)
        return b""

    def _release(self, nodeid: int, unique: int, body: memoryview) -> Later:
        fh = abi.RELEASE_IN.unpack_from(body)[0]

        def release() -> bytes:
            h = self._handles.pop(fh, None)
            if h is not None:
                try:
                    self._close_durably(nodeid, h)  # (written through mmap after the last FLUSH)
                finally:
                    os.close(h.fd)
            return b""

        return _Call(unique, Op.RELEASE, release)

    def _mkdir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        mode, umask = abi.MKDIR_IN.unpack_from(body)
        rel = self._child(nodeid, body[abi.MKDIR_IN.size:])
        path = self.volume.path(rel)
        wanted = stat.S_IMODE(mode) & ~umask
        os.mkdir(path, wanted)
        self._own(path, wanted)
        return self._entry(rel)

    def _mknod(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        mode, _rdev, umask, _ = abi.MKNOD_IN.unpack_from(body)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EPERM, "a checkpoint volume holds regular files and directories only")
        rel = self._child(nodeid, body[abi.MKNOD_IN.size:])
        path = self.volume.path(rel)
        wanted = stat.S_IMODE(mode) & ~umask
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, wanted)
        try:
            self._own(path, wanted)
            self.volume.before_write(os.fstat(fd).st_ino, rel, 0)
            self.volume.closed(rel, fd)
        finally:
            os.close(fd)
        return self._entry(rel)

    def _unlink(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self.volume.unlink(self._child(nodeid, body))
        return b""

    def _rmdir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        os.rmdir(self.volume.path(self._child(nodeid, body)))
        return b""

    def _rename(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        (newdir,) = abi.RENAME_IN.unpack_from(body)
        return self._rename_names(nodeid, newdir, bytes(body[abi.RENAME_IN.size:]), 0)

    def _rename2(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        newdir, flags, _ = abi.RENAME2_IN.unpack_from(body)
        return self._rename_names(nodeid, newdir, bytes(body[abi.RENAME2_IN.size:]), flags)

    def _rename_names(self, olddir: int, newdir: int, names: bytes, flags: int) -> bytes:
        if flags & ~abi.RENAME_NOREPLACE:
            raise OSError(errno.EINVAL, "only RENAME_NOREPLACE is supported (no RENAME_EXCHANGE or WHITEOUT)")
        old, new = names.split(b"\0")[:2]
        src, dst = self._child(olddir, old), self._child(newdir, new)
        self.volume.rename(src, dst, noreplace=bool(flags & abi.RENAME_NOREPLACE))
        self._moved(src, dst)
        return b""

    def _refuse_link(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        raise OSError(errno.EPERM, "a checkpoint volume has no hard links or symlinks (objects cannot share bytes)")

    def _readlink(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        raise OSError(errno.EINVAL, "not a symlink")

    def _opendir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        with os.scandir(self.volume.path(self._rel(nodeid))) as it:
            entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it
                             if not e.name.endswith(".cachefs-placing"))
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._dirs[fh] = entries
        return abi.OPEN_OUT.pack(fh, 0, 0)

    def _readdir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        entries = self._dirs.get(fh)
        if entries is None:  # opened under a previous daemon
            entries = self._dirs.setdefault(fh, [(e.name, e.is_dir()) for e in os.scandir(
                self.volume.path(self._rel(nodeid)))])
        out = bytearray()
        for i in range(offset, len(entries) + 2):
            name, is_dir = entries[i - 2] if i >= 2 else ("." * (i + 1), True)
            raw = name.encode("utf-8", "surrogateescape")
            if len(out) + abi.dirent_size(raw) > size:
                break
            out += abi.pack_dirent(0xFFFFFFFF if i >= 2 else nodeid, i + 1, raw, abi.DT_DIR if is_dir else abi.DT_REG)
        return bytes(out)

    def _releasedir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        self._dirs.pop(abi.RELEASE_IN.unpack_from(body)[0], None)
        return b""

    def _statfs(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        st = os.statvfs(self.volume.tree)
        return abi.KSTATFS.pack(st.f_blocks, st.f_bfree, st.f_bavail, st.f_files, st.f_ffree, st.f_bsize, 255,
                                st.f_frsize)

    def _access(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        os.lstat(self.volume.path(self._rel(nodeid)))  # (the kernel checks the modes: default_permissions)
        return b""

    def _getxattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        raise OSError(errno.ENODATA, "no such attribute")

    def _listxattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        size, _ = abi.GETXATTR_IN.unpack_from(body)
        return abi.GETXATTR_OUT.pack(0, 0) if size == 0 else b""

    def _setxattr(self, nodeid: int, unique: int, body: memoryview) -> Later:
        name = bytes(body[abi.SETXATTR_IN.size:]).split(b"\0", 1)[0]
        if name != COMMIT_XATTR:
            raise OSError(errno.ENOTSUP, "extended attributes are not kept")
        rel = self._rel(nodeid)
        if not os.path.isdir(self.volume.path(rel)):
            raise OSError(errno.ENOTDIR, "only a directory is committed")
        def commit() -> bytes:
            self.volume.commit(rel)
            return b""

        return _Call(unique, Op.SETXATTR, commit)

    def _no_xattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        raise OSError(errno.ENOTSUP, "extended attributes are not kept")

    def _fallocate(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh, offset, length, mode, _ = abi.FALLOCATE_IN.unpack_from(body)
        if mode:
            raise OSError(errno.EOPNOTSUPP, "only plain fallocate is supported")
        h = self._file(fh, nodeid)
        self.volume.before_write(h.inode, self._rel(nodeid), length)
        h.wrote = True
        os.posix_fallocate(h.fd, offset, length)
        return b""


class _Call(Later):
    """A request answered after the device is handed on: its work may wait (a download, room for a write, an
    fsync), and the other threads go on reading requests meanwhile."""

    __slots__ = ("opcode", "unique", "work")

    def __init__(self, unique: int, opcode: int, work: Callable[[], bytes]) -> None:
        self.unique, self.opcode, self.work = unique, opcode, work

    def finish(self, session: Any) -> None:
        started = time.perf_counter()
        try:
            payload = self.work()
        except BaseException as exc:  # noqa: BLE001 - every failure becomes an errno for the caller
            session._reply(self.unique, to_errno(exc, f"{Op(self.opcode).name}"))
            session.metrics.answered(self.opcode, started, ok=False)
            return
        session._reply(self.unique, 0, payload)
        session.metrics.answered(self.opcode, started)

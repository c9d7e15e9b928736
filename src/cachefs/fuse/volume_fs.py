"""A writable checkpoint volume as a file system: what :mod:`.writable` answers the kernel with, in plain values.

It is to the writable session what :mod:`.fs` is to the read-only one. Node ids are the tree's inode numbers (the
root is 1), so they survive renames and a restarted daemon finds them again by walking the tree. Writes go to the
tree file at disk speed; a sync (every ``close``'s FLUSH, FSYNC) returns once the file is durable here and queued for
the origin; rename, unlink and a commit tell the volume what the origin must see. Hard links and symlinks are
refused with EPERM. Thread-safe: the request loop calls it from several threads.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass

from cachefs.fuse.order_channel import CALLER
from cachefs.write.volume import WritableVolume

__all__ = ["ROOT", "AttrChange", "VolumeFS"]

ROOT = 1


class _Handle:
    __slots__ = ("fd", "inode", "nodeid", "writable", "wrote")

    def __init__(self, fd: int, nodeid: int, writable: bool) -> None:
        self.fd, self.nodeid, self.writable = fd, nodeid, writable
        self.inode = os.fstat(fd).st_ino
        self.wrote = False


@dataclass(frozen=True, slots=True)
class AttrChange:
    """What a SETATTR changes (None: left as it is); times in nanoseconds, ``NOW`` resolved by the caller."""

    size: int | None = None
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


class VolumeFS:
    """``volume``'s tree as the kernel sees it. ``generation``: the daemon's (a restarted daemon never reuses an
    old one's handle numbers)."""

    def __init__(self, volume: WritableVolume, *, generation: int = 0) -> None:
        self.volume = volume
        self._root_inode = os.stat(volume.tree).st_ino
        self._paths: dict[int, str] = {ROOT: ""}
        self._paths_lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._dirs: dict[int, list[tuple[str, bool]]] = {}
        self._lock = threading.Lock()
        self._next_fh = (generation << 40) + 1

    # -- node ids and paths -------------------------------------------------------------------------------------
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

    def _child(self, parent: int, name: str) -> str:
        if not name or "/" in name or name in (".", ".."):
            raise OSError(errno.EINVAL, f"bad name {name!r}")
        parent_rel = self._rel(parent)
        return f"{parent_rel}/{name}" if parent_rel else name

    def _moved(self, src: str, dst: str) -> None:
        with self._paths_lock:
            for nodeid, rel in list(self._paths.items()):
                if rel == src or rel.startswith(src + "/"):
                    self._paths[nodeid] = dst + rel[len(src):]

    def _entry(self, rel: str) -> tuple[int, os.stat_result]:
        st = os.lstat(self.volume.path(rel))
        return self._nodeid(st.st_ino, rel), st

    def _file(self, fh: int, nodeid: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:  # opened under a previous daemon: open it again
            path = self.volume.path(self._rel(nodeid))
            try:
                h = _Handle(os.open(path, os.O_RDWR | os.O_CLOEXEC), nodeid, True)
            except PermissionError:
                h = _Handle(os.open(path, os.O_RDONLY | os.O_CLOEXEC), nodeid, False)
            # The previous daemon may have taken writes through it that no close queued yet: its next FLUSH or
            # RELEASE asks the volume, which knows by the file's dirty mark (a handle counted clean here lost
            # those bytes: never uploaded, and a rename of their directory moved nothing to the origin).
            h.wrote = h.writable
            self._handles[fh] = h
        return h

    def _new_fh(self) -> int:
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
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

    # -- names and attributes -------------------------------------------------------------------------------------
    def lookup(self, parent: int, name: str) -> tuple[int, os.stat_result]:
        return self._entry(self._child(parent, name))

    def getattr(self, nodeid: int, fh: int | None) -> os.stat_result:
        """``fh``: the open file's (even if unlinked), when the kernel names one."""
        if fh is not None and fh in self._handles:
            return os.fstat(self._handles[fh].fd)
        return os.lstat(self.volume.path(self._rel(nodeid)))

    def setattr(self, nodeid: int, fh: int | None, change: AttrChange) -> os.stat_result:
        rel = self._rel(nodeid)
        path = self.volume.path(rel)
        h = self._handles.get(fh) if fh is not None else None
        if change.size is not None:
            if change.size:
                self.volume.materialize(rel)
            self.volume.before_write(os.lstat(path).st_ino, rel, 0)
            if change.size == 0:
                self.volume.open_for_write(rel, truncate=True)
            os.truncate(h.fd if h is not None else path, change.size)
        if change.mode is not None:
            os.chmod(path, stat.S_IMODE(change.mode))
        if change.uid is not None or change.gid is not None:
            os.lchown(path, -1 if change.uid is None else change.uid, -1 if change.gid is None else change.gid)
        if change.atime_ns is not None or change.mtime_ns is not None:
            st = os.lstat(path)
            os.utime(path, ns=(st.st_atime_ns if change.atime_ns is None else change.atime_ns,
                               st.st_mtime_ns if change.mtime_ns is None else change.mtime_ns))
        return os.lstat(path)

    def access(self, nodeid: int) -> None:
        os.lstat(self.volume.path(self._rel(nodeid)))  # (the kernel checks the modes: default_permissions)

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.volume.tree)

    # -- files ----------------------------------------------------------------------------------------------------
    def open(self, nodeid: int, flags: int) -> int:
        """A handle (may download the file first: blocking)."""
        rel = self._rel(nodeid)
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if writing:
            self.volume.open_for_write(rel, truncate=bool(flags & os.O_TRUNC))
        else:
            self.volume.materialize(rel)
        # Not O_APPEND: the kernel gives every WRITE its offset, and pwrite on an O_APPEND descriptor ignores it.
        fd = os.open(self.volume.path(rel), flags & os.O_ACCMODE | (flags & os.O_TRUNC) | os.O_CLOEXEC)
        fh = self._new_fh()
        self._handles[fh] = _Handle(fd, nodeid, writing)
        return fh

    def create(self, parent: int, name: str, flags: int, mode: int) -> tuple[int, os.stat_result, int]:
        """(node id, stat, handle) of a file made (or opened) for writing; ``mode``: less the caller's umask."""
        rel = self._child(parent, name)
        path = self.volume.path(rel)
        excl = os.O_EXCL if flags & os.O_EXCL else 0
        existed = os.path.lexists(path)
        if existed and not excl:
            self.volume.open_for_write(rel, truncate=bool(flags & os.O_TRUNC))
        fd = os.open(path, os.O_CREAT | excl | os.O_RDWR | (flags & os.O_TRUNC) | os.O_CLOEXEC, mode)
        if not existed:
            self._own(path, mode)
        h = _Handle(fd, 0, True)
        self.volume.before_write(h.inode, rel, 0)  # created: uploaded at close even if empty
        h.wrote = True
        h.nodeid, st = self._entry(rel)
        fh = self._new_fh()
        self._handles[fh] = h
        return h.nodeid, st, fh

    def read(self, nodeid: int, fh: int, offset: int, size: int) -> bytes:
        return os.pread(self._file(fh, nodeid).fd, size, offset)

    def write(self, nodeid: int, fh: int, offset: int, data: bytes) -> int:
        """Bytes written (may wait for room first: blocking)."""
        h = self._file(fh, nodeid)
        self.volume.before_write(h.inode, self._rel(nodeid), len(data))
        h.wrote = True
        return os.pwrite(h.fd, data, offset)

    def fallocate(self, nodeid: int, fh: int, offset: int, length: int) -> None:
        h = self._file(fh, nodeid)
        self.volume.before_write(h.inode, self._rel(nodeid), length)
        h.wrote = True
        os.posix_fallocate(h.fd, offset, length)

    def sync(self, nodeid: int, fh: int) -> None:
        """What was written through ``fh`` is durable here and queued for the origin (blocking)."""
        self._close_durably(nodeid, self._file(fh, nodeid))

    def release(self, nodeid: int, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is not None:
            try:
                self._close_durably(nodeid, h)  # (written through mmap after the last FLUSH)
            finally:
                os.close(h.fd)

    def _close_durably(self, nodeid: int, h: _Handle) -> None:
        if h.wrote:
            try:
                rel = self._rel(nodeid)
            except OSError:
                return  # unlinked meanwhile
            self.volume.closed(rel, h.fd)
            h.wrote = False

    # -- the namespace --------------------------------------------------------------------------------------------
    def mkdir(self, parent: int, name: str, mode: int, *, resent: bool = False) -> tuple[int, os.stat_result]:
        """``resent``: the kernel sent it again after a daemon died (it may have made the directory already)."""
        rel = self._child(parent, name)
        path = self.volume.path(rel)
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            if resent and os.path.isdir(path) and not os.path.islink(path):
                return self._entry(rel)
            raise
        self._own(path, mode)
        return self._entry(rel)

    def mknod(self, parent: int, name: str, mode: int) -> tuple[int, os.stat_result]:
        """An empty regular file, queued for the origin at once (``mode`` holds its type)."""
        if not stat.S_ISREG(mode):
            raise OSError(errno.EPERM, "a checkpoint volume holds regular files and directories only")
        rel = self._child(parent, name)
        path = self.volume.path(rel)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, stat.S_IMODE(mode))
        try:
            self._own(path, stat.S_IMODE(mode))
            self.volume.before_write(os.fstat(fd).st_ino, rel, 0)
            self.volume.closed(rel, fd)
        finally:
            os.close(fd)
        return self._entry(rel)

    # A request the kernel sends again after a daemon died (``resent``) may have been carried out by that daemon
    # before it could answer; one whose outcome is there already answers as done, not with the error a second try
    # of it meets (the writer saw "No such file or directory" for a rename that had happened).
    def unlink(self, parent: int, name: str, *, resent: bool = False) -> None:
        try:
            self.volume.unlink(self._child(parent, name))
        except FileNotFoundError:
            if not resent:
                raise

    def rmdir(self, parent: int, name: str, *, resent: bool = False) -> None:
        try:
            os.rmdir(self.volume.path(self._child(parent, name)))
        except FileNotFoundError:
            if not resent:
                raise

    def rename(self, olddir: int, old: str, newdir: int, new: str, *, noreplace: bool, resent: bool = False) -> None:
        src, dst = self._child(olddir, old), self._child(newdir, new)
        try:
            self.volume.rename(src, dst, noreplace=noreplace)
        except (FileNotFoundError, FileExistsError):
            if not (resent and not os.path.lexists(self.volume.path(src)) and os.path.lexists(self.volume.path(dst))):
                raise
            self.volume.renamed_already(src, dst)
        self._moved(src, dst)

    def commit(self, nodeid: int) -> None:
        """Publish the directory as a checkpoint (queued: blocking only on the journal)."""
        rel = self._rel(nodeid)
        if not os.path.isdir(self.volume.path(rel)):
            raise OSError(errno.ENOTDIR, "only a directory is committed")
        self.volume.commit(rel)

    # -- directories ----------------------------------------------------------------------------------------------
    def opendir(self, nodeid: int) -> int:
        with os.scandir(self.volume.path(self._rel(nodeid))) as it:
            entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it
                             if not e.name.endswith(".cachefs-placing"))
        fh = self._new_fh()
        self._dirs[fh] = entries
        return fh

    def listdir(self, nodeid: int, fh: int) -> list[tuple[str, bool]]:
        """The directory's (name, is a directory) as opened by ``fh``."""
        entries = self._dirs.get(fh)
        if entries is None:  # opened under a previous daemon
            entries = self._dirs.setdefault(fh, [(e.name, e.is_dir()) for e in os.scandir(
                self.volume.path(self._rel(nodeid)))])
        return entries

    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

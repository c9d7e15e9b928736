"""The FUSE replies about the tree (lookups, attributes, directories, file system statistics, access checks and
extended attributes): answered from the frozen manifest through :class:`~cachefs.fuse.fs.CacheFS`, never waiting on
the origin."""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections.abc import Callable

from cachefs.base.types import Entry
from cachefs.fuse import kernel_abi as abi
from cachefs.fuse.fs import ROOT, CacheFS
from cachefs.fuse.kernel_abi import Op, OpenFlag
from cachefs.fuse.order_channel import PUBLISH_PREFIX, publish_from_caller

__all__ = ["DIR_PAGE", "XATTR_CACHED", "DirPages", "TreeReplies"]

#: The one extended attribute: a file's bytes cached on this node.
XATTR_CACHED = b"user.cachefs.cached"


def _xattr_reply(size: int, value: bytes) -> bytes:
    """A GETXATTR/LISTXATTR answer: the value's length when asked with size 0, else the value if it fits."""
    if size == 0:
        return abi.GETXATTR_OUT.pack(len(value), 0)
    if size < len(value):
        raise OSError(errno.ERANGE, "attribute value larger than the buffer")
    return value


#: Children a directory handle holds at a time: a READDIR answer is a page of memory (about a hundred names, a few
#: dozen with READDIRPLUS), so one manifest read serves several; a directory of millions is never held whole.
DIR_PAGE = 512


class DirPages:
    """An open directory, read from the manifest a page at a time at the kernel's offsets (positions: "." 0,
    ".." 1, child ``k`` at ``k + 2``). Reading on from where the last answer stopped costs one manifest read per
    :data:`DIR_PAGE` children; an offset behind the page held (a rewind, a seekdir) reads again from the first."""

    def __init__(self, fs: CacheFS, nodeid: int) -> None:
        self.fs, self.nodeid = fs, nodeid
        self.lock = threading.Lock()  # (the kernel reads one handle at a time; a handle shared after fork may not)
        self._start = 0  # the position of _page[0] among the children
        self._page: list[Entry] = []
        self._read = False  # whether _page was read (an empty directory's page is empty)

    def child(self, k: int) -> Entry | None:
        """Child ``k`` in name order, or None past the last."""
        if k < self._start:
            self._start, self._page, self._read = 0, [], False
        while k >= self._start + len(self._page):
            if self._read and len(self._page) < DIR_PAGE:
                return None
            self.next_page()
        return self._page[k - self._start]

    def next_page(self) -> None:
        after = self._page[-1].name if self._page else None
        start = self._start + len(self._page)
        self._page = self.fs.listdir_page(self.nodeid, after, DIR_PAGE)
        self._start, self._read = start, True


class TreeReplies:
    """Each method answers one request (``nodeid``, ``unique``, the request's body) with its reply's payload, or
    raises OSError. Directory handles live here (:class:`DirPages`), read by READDIR(PLUS)."""

    def __init__(self, fs: CacheFS, timeout: float) -> None:
        self.fs, self.timeout = fs, timeout
        self._lock = threading.Lock()
        self._dirs: dict[int, DirPages] = {}
        # Directory handles carry the daemon generation, so a restarted daemon never reuses an old one's number.
        self._next_dir = ((fs.journal.state.generation if fs.journal else 0) << 40) + 1

    def ops(self) -> dict[int, Callable[[int, int, memoryview], bytes]]:
        """The handlers by opcode."""
        return {Op.LOOKUP: self.lookup, Op.GETATTR: self.getattr, Op.OPENDIR: self.opendir,
                Op.READDIR: self.readdir, Op.READDIRPLUS: self.readdirplus, Op.RELEASEDIR: self.releasedir,
                Op.STATFS: self.statfs, Op.ACCESS: self.access, Op.GETXATTR: self.getxattr,
                Op.LISTXATTR: self.listxattr, Op.FSYNC: self.empty, Op.FSYNCDIR: self.empty}

    def entry(self, ino: int, e: Entry) -> bytes:
        mode, size, mtime_ns, nlink = self.fs.attr_of(e)
        attr = abi.pack_attr(ino, size, mode, mtime_ns, nlink, self.fs.uid, self.fs.gid)
        return abi.pack_entry(ino, attr, self.timeout, self.timeout)

    def lookup(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        name = bytes(body).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        return self.entry(*self.fs.lookup(nodeid, name))

    def getattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        mode, size, mtime_ns, nlink = self.fs.attr(nodeid)
        return abi.pack_attr_out(abi.pack_attr(nodeid, size, mode, mtime_ns, nlink, self.fs.uid, self.fs.gid),
                                  self.timeout)

    def opendir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        pages = DirPages(self.fs, nodeid)
        pages.next_page()  # (a directory not listed yet is listed now; a file is refused here)
        with self._lock:
            fh = self._next_dir
            self._next_dir += 1
            self._dirs[fh] = pages
        return abi.OPEN_OUT.pack(fh, OpenFlag.CACHE_DIR | OpenFlag.KEEP_CACHE, 0)

    def dir_entries(self, nodeid: int, body: memoryview, plus: bool) -> bytes:
        """Entries from ``offset`` on ("." and ".." first), as many as fit in ``size``. With ``plus`` each
        carries its entry (a lookup the kernel will FORGET); "." and ".." carry none (nodeid 0)."""
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        pages = self._dirs.get(fh)
        if pages is None:  # opened under a previous daemon
            with self._lock:
                pages = self._dirs.setdefault(fh, DirPages(self.fs, nodeid))
        page, used = [], 0  # (position, entry or None for "." and "..", name) of what fits in ``size``
        with pages.lock:
            for i in itertools.count(offset):
                child = pages.child(i - 2) if i >= 2 else None
                if child is None and i >= 2:
                    break
                name = child.name.encode("utf-8", "surrogateescape") if child else b"." * (i + 1)
                used += abi.dirent_size(name, plus)
                if used > size:
                    break
                page.append((i, child, name))
        inos = iter(self.fs.adopt([c for _, c, _ in page if c is not None]) if plus else ())
        out = bytearray()
        for i, child, name in page:
            dtype = abi.DT_REG if child and not child.is_dir else abi.DT_DIR
            if child is None:
                ino = nodeid
                if plus:
                    out += abi.pack_entry(0, bytes(abi.ATTR.size), 0, 0)
            elif plus:
                ino, shown = next(inos)
                out += self.entry(ino, shown)
            else:
                ino = 0xFFFFFFFF  # not looked up yet; readers must not rely on d_ino (stat gives the inode)
            out += abi.pack_dirent(ino, i + 1, name, dtype)
        return bytes(out)

    def readdir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return self.dir_entries(nodeid, body, plus=False)

    def readdirplus(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return self.dir_entries(nodeid, body, plus=True)

    def releasedir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        with self._lock:
            self._dirs.pop(abi.RELEASE_IN.unpack_from(body)[0], None)
        return b""

    def statfs(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        used, avail, files, bsize = self.fs.statfs()
        free = avail // bsize
        return abi.KSTATFS.pack((used + bsize - 1) // bsize + free, free, free, files, 0, bsize, 255, bsize)

    def empty(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return b""

    def access(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        mask, _ = abi.ACCESS_IN.unpack_from(body)
        if mask & os.W_OK:
            raise OSError(errno.EROFS, "read-only file system")
        self.fs.node(nodeid)
        return b""

    def getxattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        """``user.cachefs.cached`` of a file: how many of its bytes this node holds, in decimal (what a
        cache-aware sampler asks, cachefs.torch.CacheAwareSampler); ``user.cachefs.publish:PATH`` of the root:
        publish the read order in the caller's file PATH (:mod:`.order_channel`). No other attribute exists."""
        size, _ = abi.GETXATTR_IN.unpack_from(body)
        name = bytes(body[abi.GETXATTR_IN.size:]).split(b"\0", 1)[0]
        if name.startswith(PUBLISH_PREFIX) and nodeid == ROOT:  # a read order, sent through the mount
            return _xattr_reply(size, publish_from_caller(self.fs.engine.config.cache.dir, self.fs.ds, name))
        n = self.fs.node(nodeid)
        if name != XATTR_CACHED or n.entry.is_dir:
            raise OSError(errno.ENODATA, "no such attribute")
        value = str(self.fs.engine.cached_bytes(self.fs.ds, n.entry)).encode()
        return _xattr_reply(size, value)

    def listxattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        size, _ = abi.GETXATTR_IN.unpack_from(body)
        return _xattr_reply(size, b"" if self.fs.node(nodeid).entry.is_dir else XATTR_CACHED + b"\0")

"""The read-only file system a mount serves: a dataset's frozen manifest as a tree, file bytes from the
engine. Nothing here knows the wire format; :mod:`.session` decodes requests and calls these methods,
which return plain values or raise (translated to errno by :mod:`.errno_map`).

Inodes: the root is 1; every other path gets a number derived from a hash of its path (so the same path keeps
its number across forgets and daemon restarts). What the kernel holds is in the mount's
:class:`.inode_table.InodeTable` on disk, so memory does not grow with it; a node (the inode's manifest entry and
open state) is in memory while a file of it is open or its backing file is registered, and for the inodes used
last. With a :class:`.journal.MountJournal` the rest of what a restarted daemon must know (INIT, backing ids) is
written down, and a restarted daemon picks it up (see :meth:`CacheFS.restore`).

Opens of a complete cached object are answered with passthrough (the kernel reads the local file itself)
when the kernel and our privileges allow it; otherwise reads come through userspace from the engine, which
fetches what is missing. Once an inode has a passthrough open, all its opens are passthrough until the last
one is released (the kernel requires this).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from cachefs.base.types import Entry
from cachefs.base.values import ReadAccess
from cachefs.engine import WOULD_WAIT, Dataset, Engine, LocalRead, OpenFile
from cachefs.fuse.inode_table import ROOT, InodeTable, path_ino
from cachefs.fuse.journal import MountJournal

__all__ = ["ROOT", "CacheFS", "Handle", "path_ino"]

#: Backing files kept registered after their last close, so reopening a small cached file costs no ioctl: at
#: most this many, for objects up to RETAIN_BACKING_BYTES. (A registered backing file holds its object's
#: disk space even after eviction; :meth:`CacheFS.sweep` drops those of evicted objects.)
RETAIN_BACKING = 32768
RETAIN_BACKING_BYTES = 4 << 20
#: Nodes kept in memory beyond the pinned ones (open, or with a backing file): those used last.
NODE_CACHE = 16384


class BackingFiles(Protocol):
    """The device's passthrough ioctls: a cache file registered as a backing file (its id), and let go of."""

    def open(self, fd: int) -> int: ...

    def close(self, backing_id: int) -> None: ...


@dataclass(slots=True)
class Node:
    path: str
    entry: Entry
    opens: int = 0
    backing_id: int = 0  # registered with the kernel: every open of this inode is passthrough with it
    ino: int = 0
    inherited: bool = False  # backing id taken over from a previous daemon (its opens are not counted here)
    forgotten: bool = False  # the kernel forgot it while a file of it was open: it goes at the last release
    #: Never opened since the kernel first looked it up from this daemon: its page cache is empty and no read
    #: of it can be in flight, so its bytes may be stored there before the open is answered (Handle.prefill).
    unopened: bool = False
    #: Read state of this inode's READs that name no open file (fh 0: the kernel no longer sends OPEN, see
    #: CacheFS.opens_needed).
    reads: Handle | None = None


@dataclass(slots=True)
class Handle:
    node: Node
    passthrough: bool = False
    #: Whether the kernel may keep this file's pages across opens: always without passthrough (the manifest
    #: is frozen); with it, only for files that can never be passthrough (packed small files), because the
    #: kernel refuses passthrough on an inode whose earlier opens used the page cache, and only once they
    #: are on this node, because a buffered read waiting on the origin cannot be interrupted by a signal.
    page_cache: bool = False
    #: The whole file, to put into the kernel's page cache before the open is answered (FUSE_NOTIFY_STORE), so
    #: that reading it costs no READ request: a packed small file at its first open (see CacheFS.open).
    prefill: bytes | bytearray | None = None
    #: The file as the engine opened it (its read strategy, read-ahead state, and the hold that keeps eviction
    #: away while it is open); made at the first read for handles that saw no OPEN.
    file: OpenFile | None = None


_OWNED_BY_ROOT = ReadAccess(0, 0)


class CacheFS:
    """Read-only view of one dataset (``ds``) through ``engine``; thread-safe."""

    def __init__(self, engine: Engine, ds: Dataset, *, inodes: InodeTable, access: ReadAccess = _OWNED_BY_ROOT,
                 journal: MountJournal | None = None, backing: BackingFiles | None = None,
                 prefill: bool = True) -> None:
        """``inodes``: the mount's inode table; ``backing``: the device's backing-file ioctls, used once INIT agreed
        on passthrough; ``prefill``: see :attr:`prefill`."""
        self.engine, self.ds = engine, ds
        self.journal, self.inodes = journal, inodes
        self.uid, self.gid = access.uid, access.gid
        self._file_mode, self._dir_mode = stat.S_IFREG | access.file_mode, stat.S_IFDIR | access.dir_mode
        info = ds.record.manifest(ds.version)
        root = Entry("", 0, "", info.created if info else 0.0, is_dir=True)
        # In memory: the pinned nodes and the NODE_CACHE used last (dict order: the oldest first).
        self._nodes: dict[int, Node] = {ROOT: Node("", root, ino=ROOT)}
        self._node_limit = NODE_CACHE
        self._handles: dict[int, Handle] = {}
        self._idle: OrderedDict[int, Node] = OrderedDict()  # small files with a backing id and no open file
        # File handles carry the daemon generation, so a restarted daemon never reuses an old handle's number.
        self._next_fh = (inodes.generation << 40) + 1
        self._lock = threading.Lock()
        #: Set by the session once INIT said passthrough is on.
        self.passthrough = False
        self.backing = backing
        #: Whether packed small files are stored into the page cache at their first open (``Handle.prefill``);
        #: the session turns it off if the kernel refuses FUSE_NOTIFY_STORE.
        self.prefill = prefill
        self._walked_at = -1  # the dataset's cached bytes when opens_needed last walked the manifest
        self.stats = {"passthrough_opens": 0, "userspace_opens": 0, "page_cache_opens": 0, "userspace_read_bytes": 0,
                      "prefilled_bytes": 0, "disk_waits": 0, "opens_refused": 0}

    # -- inodes ---------------------------------------------------------------------------------------------
    def node(self, ino: int) -> Node:
        n = self._nodes.get(ino)
        if n is not None:
            return n
        with self._lock:
            r = self.inodes.get(ino)
        if r is None:
            raise OSError(errno.ESTALE, f"inode {ino} is not known")
        entry = self.ds.stat(r.path)
        if r.version and r.version != entry.version:
            # Handed out while the first listing ran, and the manifest taken since names another version: its
            # pages in the kernel are of the version shown, so never serve it the other one (never a mix).
            raise OSError(errno.ESTALE, f"{r.path}: changed at the origin while the dataset was first listed")
        with self._lock:
            n = self._nodes.get(ino)
            if n is None:
                n = self._keep(Node(r.path, entry, ino=ino,
                                    unopened=r.generation == self.inodes.generation and not r.opened))
        return n

    def _keep(self, n: Node) -> Node:
        """Hold ``n`` in memory, letting go of the unpinned nodes used longest ago past the limit. With the lock held."""
        nodes = self._nodes
        nodes[n.ino] = n
        if len(nodes) > self._node_limit:
            unpinned = [i for i, m in nodes.items() if not (m.opens or m.backing_id or i == ROOT)]
            for ino in unpinned[:len(nodes) - self._node_limit // 2]:
                del nodes[ino]
            if len(nodes) > self._node_limit * 3 // 4:  # (mostly pinned: grow, so that sweeps stay rare)
                self._node_limit = 2 * len(nodes)
        return n

    def restore(self) -> None:
        """Take over from a previous daemon: the backing ids its journal lists (its inodes are in the table).
        Files it opened stay open in the kernel, uncounted here, so inherited backing ids are dropped only when
        the kernel forgets the inode (then no file of it can be open)."""
        assert self.journal is not None, "a restored mount has its journal"
        for ino, backing in self.journal.state.backing.items():
            try:
                n = self.node(ino)
            except OSError:
                self._backing_close_quietly(backing)
                continue
            n.backing_id, n.inherited = backing, True

    def lookup(self, parent: int, name: str) -> tuple[int, Entry]:
        p = self.node(parent)
        if not p.entry.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, p.path)
        entry = self.ds.stat(f"{p.path}/{name}" if p.path else name)  # FileNotFoundError → ENOENT
        with self._lock:
            ((ino, r),) = self.inodes.looked_up([(entry.path, entry.version if self.ds.provisional else "")])
            n = self._nodes.get(ino)
            if n is not None:
                n.forgotten = False  # (the kernel holds it again)
            elif not r.version or r.version == entry.version:
                # A LOOKUP is followed by the inode's GETATTR, OPEN or READ: keep its node (a walk's READDIRPLUS
                # makes none). An inode a previous daemon handed out may have cached pages and reads in flight.
                n = self._keep(Node(entry.path, entry, ino=ino,
                                    unopened=r.generation == self.inodes.generation and not r.opened))
        return ino, entry if n is None else n.entry

    def adopt(self, entries: list[Entry]) -> list[tuple[int, Entry]]:
        """The inodes of ``entries`` (manifest entries the caller has in hand), counting one kernel lookup of each,
        with the entry to show for each (a node's in memory, else the one given); READDIRPLUS hands a page of
        children at once, saving the manifest lookup per child. No node is made: a walk leaves memory as it was."""
        shown = self.ds.provisional
        with self._lock:
            found = self.inodes.looked_up([(e.path, e.version if shown else "") for e in entries])
            out = []
            for (ino, _), e in zip(found, entries, strict=True):
                n = self._nodes.get(ino)
                if n is not None:
                    n.forgotten = False  # (the kernel holds it again)
                out.append((ino, e if n is None else n.entry))
            return out

    def forget(self, items: list[tuple[int, int]]) -> None:
        """The kernel dropped ``nlookup`` references to each (ino, nlookup)."""
        drop = []
        with self._lock:
            for ino in self.inodes.forget([(i, k) for i, k in items if i != ROOT]):
                n = self._nodes.get(ino)
                if n is None:
                    continue
                if n.opens:
                    n.forgotten = True  # (it goes at its last release)
                    continue
                del self._nodes[ino]
                self._idle.pop(ino, None)
                if n.backing_id:  # the kernel forgot the inode: none of its files is open
                    drop.append(n)
        for n in drop:
            self._drop_backing(n)

    def attr(self, ino: int) -> tuple[int, int, int, int]:
        """(mode, size, mtime_ns, nlink)"""
        return self.attr_of(self.node(ino).entry)

    def attr_of(self, e: Entry) -> tuple[int, int, int, int]:
        """(mode, size, mtime_ns, nlink) of a manifest entry."""
        mtime_ns = int(e.mtime * 1e9)
        if e.is_dir:
            return self._dir_mode, 0, mtime_ns, 2
        return self._file_mode, e.size, mtime_ns, 1

    def listdir_page(self, ino: int, after: str | None, limit: int) -> list[Entry]:
        """At most ``limit`` children of directory ``ino`` whose names sort after ``after`` (None: from the first)."""
        n = self.node(ino)
        if not n.entry.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, n.path)
        return self.ds.listdir_page(n.path, after, limit)

    # -- files ----------------------------------------------------------------------------------------------
    def open(self, ino: int, flags: int) -> tuple[int, Handle]:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_CREAT):
            raise OSError(errno.EROFS, "read-only file system")
        n = self.node(ino)
        if n.entry.is_dir:
            raise IsADirectoryError(errno.EISDIR, n.path)
        file = self.engine.open(self.ds, n.entry)
        h = Handle(n, file=file)
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = h
            n.opens += 1
            first, n.unopened = n.unopened, False
            if first:
                self.inodes.opened(n.ino)
            self._idle.pop(n.ino, None)
        if self.passthrough and (n.backing_id or self._register_backing(n, file)):
            h.passthrough = True
            file.read_by_kernel()
        if not h.passthrough:
            # Only at the first open: a page another open cached, or a READ the kernel has in flight for it,
            # would make the store wait on a locked page, and the request thread holding the device with it.
            if first and self.prefill and n.entry.size > 0 and file.packed:
                whole = file.read_local(0, n.entry.size, wait=False)
                packed = whole is not None  # WOULD_WAIT: here, but on disk only; its READ will not hold the device
                h.prefill = None if whole is WOULD_WAIT else whole
            else:
                packed = self.passthrough and self._packed_here(n.entry)
            h.page_cache = not self.passthrough or packed
        self.stats["passthrough_opens" if h.passthrough else "userspace_opens"] += 1
        self.stats["page_cache_opens"] += h.page_cache
        return fh, h

    def opens_needed(self, check_local: bool = True) -> bool:
        """Whether the kernel must go on sending OPEN and RELEASE. Not when every file is a packed small file
        (none can ever be passthrough) and, with ``check_local`` (passthrough on), each is on this node: then
        every open gets the same answer (page cache, nothing to register) and a READ brings what a prefill
        would, so the session answers OPEN with ENOSYS and the kernel opens files without asking for the rest
        of the mount (``fc->no_open``): a small file in the page cache then costs no request at all. (An open
        of a file that is not here is answered direct-I/O in passthrough mode, so that a read waiting on the
        origin can be interrupted; once opens are skipped, a file evicted later is read through the page
        cache, where only a fatal signal or the origin timeout ends such a wait.) May walk the manifest."""
        if not self.engine.every_file_packed_here(self.ds, here=False):
            return True
        if not check_local:
            return False
        cached = self.engine.dataset_cached_bytes(self.ds)
        if cached == self._walked_at:
            return True
        self._walked_at = cached  # walk again only once the cache holds something else
        return not self.engine.every_file_packed_here(self.ds)

    def _packed_here(self, entry) -> bool:
        return self.engine.strategy(entry).packed and self.engine.cached_bytes(self.ds, entry) == entry.size

    def _register_backing(self, n: Node, file: OpenFile) -> bool:
        """Hand the complete local file of ``n`` to the kernel (once per inode; concurrent opens share it).
        Its descriptor comes from the open (pinned) file, never from a path eviction could swap under us."""
        try:
            fd = file.local_fd()
        except OSError:
            return False
        if fd is None:
            return False
        if self.backing is None:
            os.close(fd)
            return False
        try:
            backing = self.backing.open(fd)
        except OSError:
            self.passthrough = False  # e.g. EPERM without CAP_SYS_ADMIN: userspace from now on
            return False
        finally:
            os.close(fd)  # the kernel keeps its own reference to the backing file
        with self._lock:
            if n.backing_id:  # lost a race with another open: use its id, drop ours
                duplicate = backing
            else:
                duplicate, n.backing_id = 0, backing
                if self.journal is not None:
                    self.journal.backing(n.ino, backing)
        if duplicate:
            self._backing_close_quietly(duplicate)
        return True

    def read_local(self, ino: int, fh: int, offset: int, size: int, *, wait: bool = True) -> LocalRead:
        """The bytes if every block is in the local store, else None: use :meth:`fetch`. Without ``wait``,
        WOULD_WAIT if a packed file's bytes are on disk but not in the page cache (see Engine.read_local)."""
        data = self._file(ino, fh).read_local(offset, offset + size, wait=wait)
        if data is WOULD_WAIT:
            self.stats["disk_waits"] += 1
        elif data is not None:
            self.stats["userspace_read_bytes"] += len(data)
        return data

    async def fetch(self, ino: int, fh: int, offset: int, size: int) -> bytes | bytearray:
        """The bytes, fetching what is missing from the origin (runs on the cachefs event loop)."""
        data = await self._file(ino, fh).read(offset, offset + size)
        self.stats["userspace_read_bytes"] += len(data)
        return data

    def _file(self, ino: int, fh: int) -> OpenFile:
        h = self._handle(ino, fh)
        assert h.file is not None  # (made by _handle)
        return h.file

    def _handle(self, ino: int, fh: int) -> Handle:
        if not fh:  # no OPEN was sent (open-less mode): the inode's own read state
            n = self.node(ino)
            h = n.reads
            if h is None:
                h = n.reads = Handle(n)
        else:
            h = self._handles.get(fh)
        if h is None:  # opened under a previous daemon: the request names the inode, which is all we need
            fresh = Handle(self.node(ino))
            with self._lock:
                h = self._handles.setdefault(fh, fresh)
                if h is fresh:  # (counted as an open, so that its node stays in memory until the release)
                    h.node.opens += 1
        if h.file is None:
            h.file = self.engine.open(self.ds, h.node.entry, pin=False)
        return h

    def release(self, ino: int, fh: int) -> None:
        """Last close of an open file. A small file's backing stays registered (idle) for the next open; a
        large one's is dropped (its open costs little next to its reads)."""
        close: list[Node] = []
        with self._lock:
            h = self._handles.pop(fh, None)
        if h is None:
            return
        if h.file is not None:
            h.file.close()
        with self._lock:
            n = h.node
            n.opens = max(0, n.opens - 1)
            if n.opens:
                return
            if n.forgotten:
                if self._nodes.get(n.ino) is n:
                    del self._nodes[n.ino]
                if n.backing_id:
                    close.append(n)
            elif not n.backing_id or n.inherited:
                return
            elif n.entry.size > RETAIN_BACKING_BYTES:
                close.append(n)
            else:
                self._idle[n.ino] = n
                while len(self._idle) > RETAIN_BACKING:
                    close.append(self._idle.popitem(last=False)[1])
        for c in close:
            self._drop_backing(c)

    def sweep(self) -> int:
        """Drop the idle backing files of objects that are no longer complete in the cache (evicted), so the
        kernel does not keep their disk space; returns how many were dropped."""
        with self._lock:
            idle = list(self._idle.values())
        gone = [n for n in idle if self.engine.local_path(self.ds, n.entry) is None]
        with self._lock:
            gone = [n for n in gone if self._idle.pop(n.ino, None) is not None]
        for n in gone:
            self._drop_backing(n)
        return len(gone)

    def _drop_backing(self, n: Node) -> None:
        with self._lock:
            backing, n.backing_id = n.backing_id, 0
        if backing:
            self._backing_close_quietly(backing)
            if self.journal is not None:
                self.journal.backing_closed(n.ino)

    def _backing_close_quietly(self, backing_id: int) -> None:
        if self.backing is None:
            return
        try:
            self.backing.close(backing_id)
        except OSError:
            pass

    def backing_id(self, h: Handle) -> int:
        return h.node.backing_id if h.passthrough else 0

    def statfs(self) -> tuple[int, int, int, int]:
        """(used bytes, available bytes, files, block size): the dataset's size (from the manifest) is what is
        used; what is available is the room the node's cache has left. A read-only dataset reported as a full
        disk (0 available) trips every disk-usage alert; this says how much more of it the node can cache."""
        files, nbytes = self.ds.size()  # (while the first listing runs: what is listed so far)
        try:
            room = self.engine.room()
        except OSError:
            room = 0
        return nbytes, room, files, 4096

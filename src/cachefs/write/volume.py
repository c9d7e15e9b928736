"""A writable volume: a directory tree on the node's disk whose closed files go to the origin, in order.

The front doors change the tree with ordinary file operations and tell the volume at the points that matter:
:meth:`WritableVolume.before_write` (room, and a copy for a file whose closed version still waits for its upload),
:meth:`~WritableVolume.closed` (durable here and queued), :meth:`~WritableVolume.rename`,
:meth:`~WritableVolume.unlink` and :meth:`~WritableVolume.commit` (what the origin must see, queued in order).
Thread-safe: every change to the tree and the queue holds the queue's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable
from typing import Any

from cachefs.base.aio import run_soon, run_sync
from cachefs.base.config import Config, resolve_size
from cachefs.base.files import atomic_write
from cachefs.sources import open_object_writes, open_origin
from cachefs.write import remote, report
from cachefs.write.queue import EntryKind, QueueEntry, UploadQueue, fsync_dir, under
from cachefs.write.replicas import Replicator
from cachefs.write.services import NodeServices
from cachefs.write.staging import StagingRoom
from cachefs.write.uploader import Uploader

__all__ = ["WritableVolume"]

log = logging.getLogger(__name__)


class WritableVolume:
    """One volume: ``<dir>/tree`` (what the front door shows), ``<dir>/queue`` (snapshots of closed files waiting
    for their upload), ``<dir>/journal`` (the queue), ``<dir>/status.json`` (what ``cachefs status`` shows)."""

    def __init__(self, config: Config, url: str, vdir: str, *, writer: str, storage_options: dict | None = None,
                 services: NodeServices = NodeServices.NONE) -> None:
        self.config, self.url, self.dir, self.writer = config, url.rstrip("/"), vdir, writer
        self.tree = os.path.join(vdir, "tree")
        self.snapdir = os.path.join(vdir, "queue")
        os.makedirs(self.tree, exist_ok=True)
        os.makedirs(self.snapdir, exist_ok=True)
        #: Held for every change to the tree together with the queue (which guards itself with it too).
        self.lock = threading.RLock()
        self.queue = UploadQueue(os.path.join(vdir, "journal"), self.lock)
        self.source = open_origin(self.url, config, storage_options)
        k = config.checkpoint
        self.budget = services.budget
        self.uploader = Uploader(self.queue, self.url, self, open_object_writes(self.url, config, storage_options),
                                 self.source, writer=writer, part_size=k.part_size, concurrency=k.upload_concurrency,
                                 backoff_max=config.origin.backoff_max, budget=self.budget)
        self.replicator = Replicator(services.group, self.url, config.checkpoint.replicas)
        st = os.statvfs(vdir)
        total = st.f_blocks * st.f_frsize
        self.room = StagingRoom(vdir, limit=resolve_size(k.staging_limit, total, "checkpoint.staging_limit"),
                                min_free=resolve_size(config.cache.min_free, total, "cache.min_free"),
                                stall_timeout=k.stall_timeout, staged=self,
                                make_room=[f for f in (services.make_room, self.drop_clean) if f is not None])
        #: Objects on the origin now, key → (size, ETag): the listing at start, then every upload, copy and delete
        #: that finished.
        self.origin_keys: dict[str, tuple[int, str]] = {}
        self._dirty: dict[int, int] = {}  # inode → bytes written since its last close
        self._snap_inode: dict[int, int] = {}  # snapshot → its inode (a write to that inode copies it first)
        self._downloads: dict[str, threading.Event] = {}
        self._stopped = threading.Event()
        self._status_written = threading.Lock()  # (one writer of status.json at a time: they share its temp file)
        self._status_thread: threading.Thread | None = None
        #: The owner lock's descriptor (open_volume takes it), released by stop().
        self.lock_fd: int | None = None

    def snapshot(self, snap: int) -> str:
        return os.path.join(self.snapdir, str(snap))

    def path(self, rel: str) -> str:
        return os.path.join(self.tree, rel) if rel else self.tree

    # -- life ---------------------------------------------------------------------------------------------------
    async def start(self, *, list_origin: bool = True) -> None:
        """Show the origin's objects (unless ``list_origin`` is false) and start uploading what is queued."""
        remote.check_xattrs(self.tree)
        self._drop_orphan_snapshots()
        for e in self.queue.pending(lambda e: e.kind is EntryKind.PUT):
            try:
                self._snap_inode[e.snap] = os.stat(self.snapshot(e.snap)).st_ino
            except FileNotFoundError:
                log.error("%s: the snapshot of %s is missing; its upload is dropped", self.dir, e.key)
                self.queue.drop(e)
        if list_origin:
            keep = {e.key for e in self.queue.pending(lambda e: e.kind.makes_object)}
            self.origin_keys = await remote.list_into_tree(self.source, self.url, self.tree, keep)
            # Files other members hold copies of, not on the origin yet: their writer's upload is pending (or its
            # node is gone). They show as placeholders read from those members.
            for key, (member, entry, size) in (await self.replicator.held()).items():
                if key not in self.origin_keys and key not in keep and not remote.is_internal(key):
                    await asyncio.to_thread(remote.place_copy, self.tree, key, size, member, entry)
        self.uploader.start()
        self._status_thread = threading.Thread(target=self._publish_status, name="cachefs-volume-status", daemon=True)
        self._status_thread.start()

    def _drop_orphan_snapshots(self) -> None:
        """Snapshots no queued upload names: linked by a close that died before its entry was journalled (that
        close was never acknowledged: the kernel sends it again, and it queues the tree's file anew). Left there,
        the next snapshot of the same number (numbers are taken again from the journal) met the file: EEXIST to
        the writer's close."""
        live = {str(e.snap) for e in self.queue.pending(lambda e: e.kind is EntryKind.PUT)}
        for name in os.listdir(self.snapdir):
            if name not in live:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.snapdir, name))

    async def stop(self) -> None:
        self._stopped.set()
        await self.uploader.stop()
        await self.uploader.writes.close()
        await self.source.close()
        self.queue.close()
        self._write_status()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    # -- writes -------------------------------------------------------------------------------------------------
    def open_for_write(self, rel: str, *, truncate: bool) -> None:
        """A writer opens ``rel``: the origin's bytes are fetched first unless the open truncates."""
        path = self.path(rel)
        if truncate:
            remote.drop_xattr(path, remote.REMOTE)
            remote.drop_xattr(path, remote.CLEAN)
        else:
            self.materialize(rel)
        self.before_write(os.stat(path).st_ino, rel, 0)

    def before_write(self, inode: int, rel: str, nbytes: int) -> None:
        """``nbytes`` are about to be written to ``rel`` (inode ``inode``): wait for room, copy a snapshot that
        shares the inode, mark the file dirty. Blocking."""
        if nbytes:
            self.room.take(nbytes)
        with self.lock:
            if inode in self._snap_inode.values():
                self._copy_snapshots(inode)
            if inode not in self._dirty:
                os.setxattr(self.path(rel), remote.DIRTY, b"1")
                remote.drop_xattr(self.path(rel), remote.CLEAN)
                self._dirty[inode] = 0
            self._dirty[inode] += nbytes

    def closed(self, rel: str, fd: int) -> QueueEntry | None:
        """The writer closed (or fsynced) ``rel`` through ``fd``: its bytes are fsynced, a snapshot is linked into
        the queue and journalled. Returns when that is durable; the upload follows."""
        st = os.fstat(fd)
        path = self.path(rel)
        with self.lock:
            dirty = st.st_ino in self._dirty or remote.xattr(path, remote.DIRTY) is not None
            try:
                here = os.stat(path).st_ino == st.st_ino
            except FileNotFoundError:
                here = False
            if not dirty or not here:
                self._dirty.pop(st.st_ino, None)
                return None  # nothing written, or unlinked meanwhile: nothing to upload
            os.fsync(fd)
            e = self._queue_put(rel, st)
            self._dirty.pop(st.st_ino, None)
            remote.drop_xattr(path, remote.DIRTY)
        if self.replicator.wanted:  # (outside the lock: the network)
            self._replicate(e)
            # The copies close promised show in ``cachefs status`` once it returns (the periodic write lags up to
            # 0.2 s: a status read just after close showed the file below its promise).
            self._write_status()
        return e

    def _queue_put(self, rel: str, st: os.stat_result, *, before: QueueEntry | None = None) -> QueueEntry:
        """Link a snapshot of the tree's ``rel`` (``st``: its stat) into the queue and journal its upload, durably.
        Called with the lock held."""
        snap = self.queue.reserve_seq()
        os.link(self.path(rel), self.snapshot(snap))
        fsync_dir(self.snapdir)
        e = self.queue.add(EntryKind.PUT, rel, size=st.st_size, snap=snap, before=before)
        self._snap_inode[snap] = st.st_ino
        return e

    def _replicate(self, e: QueueEntry) -> None:
        """Before ``close`` returns: a copy on ``checkpoint.replicas`` other members of the group."""
        try:
            members = run_sync(self.replicator.push(e.snap, e.key, self.snapshot(e.snap), e.size))
        except FileNotFoundError:  # uploaded (and its snapshot dropped) meanwhile: nothing to copy
            return
        with self.lock:
            if e in self.queue.entries:
                self.queue.held(e, members)
                return
        run_soon(self.replicator.drop(members, e.snap))  # uploaded meanwhile

    def _copy_snapshots(self, inode: int) -> None:
        """Give the queued snapshots of ``inode`` their own copy before the file changes (a running upload is let
        finish first)."""
        for snap in [s for s, i in self._snap_inode.items() if i == inode]:
            while any(e.running and e.snap == snap for e in self.queue.pending()):
                self.queue.wait_changed(1.0)
            if snap not in self._snap_inode:
                continue  # its upload finished meanwhile
            tmp = self.snapshot(snap) + ".copy"
            shutil.copyfile(self.snapshot(snap), tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.snapshot(snap))
            self._snap_inode[snap] = os.stat(self.snapshot(snap)).st_ino

    def materialize(self, rel: str) -> None:
        """Download ``rel`` if it is a placeholder of an object on the origin, or of a copy a member holds (one
        download per file). Blocking."""
        path = self.path(rel)
        if remote.xattr(path, remote.REMOTE) is None and remote.xattr(path, remote.COPY) is None:
            return
        with self.lock:
            running = self._downloads.get(rel)
            if running is None:
                event = self._downloads[rel] = threading.Event()
        if running is not None:
            running.wait()
            return
        try:
            k = self.config.checkpoint
            copy = remote.xattr(path, remote.COPY)
            if copy is not None:
                run_sync(remote.download_copy(self.replicator, path, copy))
            else:
                run_sync(remote.download(self.source, f"{self.url}/{rel}", path, part_size=k.part_size,
                                         concurrency=k.upload_concurrency, budget=self.budget))
        finally:
            with self.lock:
                self._downloads.pop(rel, None)
            event.set()

    # -- the namespace ------------------------------------------------------------------------------------------
    def rename(self, src: str, dst: str, *, noreplace: bool = False) -> None:
        """Rename in the tree, and queue what the origin must see: entries not started go to the end under the new
        name; objects already there are copied and deleted. ``X.tmp`` → ``X`` for a directory, and DCP's
        ``.metadata.tmp`` → ``.metadata``, commit the checkpoint directory."""
        with self.lock:
            sp, dp = self.path(src), self.path(dst)
            if noreplace and os.path.lexists(dp):
                raise FileExistsError(17, "File exists", dst)
            was_dir = os.path.isdir(sp)
            os.rename(sp, dp)
            self._queue_rename(src, dst, was_dir)

    def renamed_already(self, src: str, dst: str) -> None:
        """``src`` was renamed to ``dst`` in the tree by a daemon that died before it could answer: queue what the
        origin must see, again (what that daemon queued already is found done, or done twice alike: a copy of the
        same bytes, a claim and a commit record by the same writer)."""
        with self.lock:
            self._queue_rename(src, dst, os.path.isdir(self.path(dst)))

    def _queue_rename(self, src: str, dst: str, was_dir: bool) -> None:
        """The queue's side of a rename (the lock held)."""
        def moved(key: str) -> str:
            return dst + key[len(src):]

        targets = set()
        for e in self.queue.pending(lambda e: not e.running and e.kind.makes_object and under(e.key, src)):
            old = e.seq
            self.queue.move(e, moved(e.key))
            self.uploader.forget_prepared(old)
            targets.add(e.key)
            if e.held_by:
                run_soon(self.replicator.rekey(e.held_by, e.snap, e.key))
        deleting = {e.key for e in self.queue.pending(lambda e: e.kind is EntryKind.DELETE)}
        there = {k: n for k, (n, _) in self.origin_keys.items() if under(k, src) and k not in deleting}
        for e in self.queue.pending(lambda e: e.running and e.kind.makes_object and under(e.key, src)):
            there[e.key] = e.size
        for key, size in sorted(there.items()):
            if moved(key) not in targets:  # (a newer version goes up under that name anyway)
                self.queue.add(EntryKind.COPY, moved(key), src=key, size=size)
            self.queue.add(EntryKind.DELETE, key)
        if os.path.basename(src) == ".metadata.tmp" and os.path.basename(dst) == ".metadata":
            self.commit(os.path.dirname(dst))
        elif was_dir and src == dst + ".tmp":
            self.commit(dst)

    def unlink(self, rel: str) -> None:
        with self.lock:
            inode = os.lstat(self.path(rel)).st_ino
            os.unlink(self.path(rel))
            for e in self.queue.pending(lambda e: not e.running and e.kind.makes_object and e.key == rel):
                self.queue.drop(e)
                self.uploader.forget_prepared(e.seq)
                self._forget_snapshot(e)
                if e.held_by:
                    run_soon(self.replicator.drop(e.held_by, e.snap))
            running = self.queue.pending(lambda e: e.running and e.kind.makes_object and e.key == rel)
            if rel in self.origin_keys or running:
                self.queue.add(EntryKind.DELETE, rel)
            self._dirty.pop(inode, None)

    def remove_remote(self, rel: str) -> None:
        """Delete an object this volume's tree does not show (a writer that never listed the origin)."""
        self.queue.add(EntryKind.DELETE, rel)

    def move_remote(self, src: str, dst: str, size: int) -> None:
        """Rename an object this volume's tree does not show: copied, then deleted, in order."""
        with self.lock:
            self.queue.add(EntryKind.COPY, dst, src=src, size=size)
            self.queue.add(EntryKind.DELETE, src)

    def commit(self, rel: str) -> None:
        """Publish the checkpoint directory ``rel``: its name is claimed before any of its objects not yet
        uploaded, and its commit record is written after all of them."""
        with self.lock:
            first = next(iter(self.queue.pending(
                lambda e: not e.running and (e.kind.makes_object or e.kind is EntryKind.DELETE) and under(e.key, rel))),
                None)
            self.queue.add(EntryKind.CLAIM, rel, before=first)
            self.queue.add(EntryKind.COMMIT, rel)

    # -- the uploader's news and questions (UploadOwner) -------------------------------------------------------
    def origin_etag(self, key: str) -> str:
        with self.lock:
            return self.origin_keys.get(key, (0, ""))[1]

    def uploaded(self, e: QueueEntry, failed: str) -> None:
        with self.lock:
            if e.kind is EntryKind.PUT:
                if not failed:
                    self._mark_clean(e)
                self._forget_snapshot(e)
                if e.held_by and not failed:  # on the origin: the copies have done their work
                    run_soon(self.replicator.drop(e.held_by, e.snap))
            if failed:
                return
            if e.kind.makes_object:
                self.origin_keys[e.key] = (e.size, e.etag)
            elif e.kind is EntryKind.DELETE:
                self.origin_keys.pop(e.key, None)

    def reupload(self, copy: QueueEntry, etag: str) -> bool:
        """The source of ``copy`` (a rename after the upload) no longer has ``etag``: another writer replaced or
        deleted the object of that name. Queue a put of the tree's own bytes in the copy's place, if the tree's file
        is still the one uploaded as ``etag`` (not a placeholder, not written since), and drop the copy."""
        with self.lock:
            path = self.path(copy.key)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return False
            ours = (etag and stat.S_ISREG(st.st_mode) and st.st_size == copy.size and st.st_ino not in self._dirty
                    and all(remote.xattr(path, x) is None for x in (remote.DIRTY, remote.REMOTE, remote.COPY))
                    and remote.xattr(path, remote.CLEAN) in (None, etag))
            if not ours or copy not in self.queue.entries:
                return False
            self._queue_put(copy.key, st, before=copy)
            self.queue.drop(copy)
            return True

    def _mark_clean(self, e: QueueEntry) -> None:
        """The tree's file is the object just uploaded (same inode, not written since): a clean copy, which
        :meth:`drop_clean` may turn back into a placeholder when the disk needs room."""
        path = self.path(e.key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if (st.st_ino == self._snap_inode.get(e.snap) and st.st_ino not in self._dirty and st.st_size == e.size
                and remote.xattr(path, remote.DIRTY) is None and e.etag):
            os.setxattr(path, remote.CLEAN, e.etag.encode())

    def drop_clean(self, need: int) -> int:
        """Turn clean copies back into placeholders, least lately read first, until ``need`` bytes are freed (or
        none is left); bytes freed. Blocking."""
        with self.lock:
            clean = []
            for dirpath, _dirs, files in os.walk(self.tree):
                for name in files:
                    path = os.path.join(dirpath, name)
                    if remote.xattr(path, remote.CLEAN) is not None and os.lstat(path).st_ino not in self._dirty:
                        st = os.lstat(path)
                        clean.append((st.st_atime, path, st.st_blocks * 512))
            freed = 0
            for _atime, path, nbytes in sorted(clean):
                if freed >= need:
                    break
                remote.to_placeholder(path)
                freed += nbytes
            return freed

    def _forget_snapshot(self, e: QueueEntry) -> None:
        if e.kind is EntryKind.PUT and e.snap:
            self._snap_inode.pop(e.snap, None)
            try:
                os.unlink(self.snapshot(e.snap))
            except FileNotFoundError:
                pass

    # -- what it holds ------------------------------------------------------------------------------------------
    def queued_bytes(self) -> int:
        with self.lock:
            return sum(e.size for e in self.queue.entries if e.kind is EntryKind.PUT)

    def dirty_bytes(self) -> int:
        """Bytes written to open files since their last close (not in the queue yet)."""
        with self.lock:
            return sum(self._dirty.values())

    def last_progress(self) -> float:
        return self.uploader.last_progress

    def wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``done()``, checked with the lock held whenever the queue changes;
        whether it is."""
        with self.lock:
            return self.queue.changed.wait_for(done, timeout=timeout)

    def status(self) -> dict[str, Any]:
        """What ``cachefs status`` shows about this volume (:func:`.report.volume_status`)."""
        return report.volume_status(self.queue, self.uploader, dirty=self.dirty_bytes(),
                                    wanted=self.replicator.wanted, staging_limit=self.room.limit,
                                    writers_waiting=self.room.waiting, url=self.url, dir=self.dir, writer=self.writer)

    def _write_status(self) -> dict[str, Any]:
        with self._status_written:
            st = self.status()
            try:
                atomic_write(os.path.join(self.dir, "status.json"), json.dumps(st))
            except OSError as exc:
                log.debug("volume status not written: %s", exc)
        report.export_metrics(st)
        return st

    def _publish_status(self) -> None:
        # (at once, then every 0.2 s: a status read just after the first close found no volume status yet)
        while True:
            try:
                self._write_status()
            except Exception:
                log.exception("volume status")
            if self._stopped.wait(0.2):
                return

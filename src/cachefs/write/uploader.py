"""The background upload of a volume's queue, in order.

Entries *finish* strictly in queue order: an object appears on the origin (a single PUT, or the completion of its
multipart upload) only after every entry before it finished, so a marker written last lands last. The parts of the
next few large files upload meanwhile (``checkpoint.upload_concurrency`` parts in flight, each within the memory
budget); parts are invisible until completed, so that keeps the order and the link busy. Failures are retried:
each request by the sources' policy, the entry again after a backoff until it succeeds; a lost commit race fails
the entries of that checkpoint for good, and the queue goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Protocol

from cachefs.base.errors import CacheFSError, CommitConflictError, ObjectNotFoundError, StaleObjectError
from cachefs.base.metrics import CHECKPOINT_FAILURES, CHECKPOINT_UPLOADED_BYTES, result_of, safely
from cachefs.node.budget import MemoryBudget
from cachefs.sources import Source
from cachefs.sources.writes import ObjectWrites
from cachefs.write import commits
from cachefs.write.queue import EntryKind, QueueEntry, UploadQueue, under

__all__ = ["UploadOwner", "Uploader"]

log = logging.getLogger(__name__)

#: Entries whose parts may upload ahead of the one finishing.
LOOKAHEAD = 8


class UploadOwner(Protocol):
    """What the uploader needs of the volume whose queue it runs (thread-safe, quick: called on the loop)."""

    def snapshot(self, snap: int) -> str:
        """The path of a put's snapshot."""

    def origin_etag(self, key: str) -> str:
        """The ETag the volume knows the origin's object ``key`` by ("" if none): a copy is made only while its
        source still has it."""

    def uploaded(self, e: QueueEntry, failed: str) -> None:
        """``e`` finished (``failed``: given up for good, and why)."""

    def reupload(self, copy: QueueEntry, etag: str) -> bool:
        """The source of ``copy`` no longer has ``etag`` (another writer replaced or deleted it): queue a put of
        the tree's own bytes in the copy's place (True), or say there are none here (False: the copy fails)."""


class Uploader:
    """Runs ``queue`` against the origin at ``url`` (the volume's root), on the event loop, for ``owner``."""

    def __init__(self, queue: UploadQueue, url: str, owner: UploadOwner, writes: ObjectWrites, source: Source, *,
                 writer: str, part_size: int, concurrency: int, backoff_max: float,
                 budget: MemoryBudget | None = None) -> None:
        self.queue, self.url, self.owner = queue, url.rstrip("/"), owner
        self.writes, self.source, self.writer = writes, source, writer
        self.part_size, self.backoff_max, self.budget = part_size, backoff_max, budget
        self._parts = asyncio.Semaphore(concurrency)
        self._prepared: dict[int, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        #: The last failure of the entry at the head, while it is retried ("" when none).
        self.last_error = ""
        self.failures = 0
        self.rate = 0.0  # bytes per second of the last finished upload
        self.last_progress = time.monotonic()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.queue.on_change = self.wake
        self._task = asyncio.ensure_future(self._run())

    def wake(self) -> None:
        """Look at the queue again (callable from any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def forget_prepared(self, seq: int) -> None:
        """Entry ``seq`` was renamed or dropped before it finished: drop the parts uploaded under its old key (any
        thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cancel_prepared, seq)

    def _cancel_prepared(self, seq: int) -> None:
        task = self._prepared.pop(seq, None)
        if task is not None:
            task.cancel()
        self._wake.set()

    async def stop(self) -> None:
        self._stopping = True
        if self.queue.on_change == self.wake:
            self.queue.on_change = None  # (the queue outlives its loop: a later change wakes no one)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in self._prepared.values():
            task.cancel()
        await asyncio.gather(*self._prepared.values(), return_exceptions=True)
        self._prepared.clear()

    # -- the loop -----------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        await self._abort_leftovers()
        delay = 0.0
        while True:
            head = self.queue.head(LOOKAHEAD)
            if not head:
                self._wake.clear()
                await self._wake.wait()
                continue
            for e in head:
                if e.kind is EntryKind.PUT and e.size > self.part_size and e.seq not in self._prepared:
                    self._prepared[e.seq] = asyncio.ensure_future(self._prepare(e, e.key))
            first = head[0]
            try:
                await self._finish(first)
            except _Renamed:
                continue  # moved or preceded meanwhile (its parts, if any, went up under an old name): the head again
            except CommitConflictError as exc:
                self._give_up(first, str(exc))
                continue
            except _SourceReplaced as exc:
                if not self.owner.reupload(first, exc.etag):
                    self._give_up(first, f"{first.key}: its source {first.src} was replaced or deleted by another "
                                         f"writer, and this node does not hold its bytes")
                continue
            except Exception as exc:  # noqa: BLE001 - any failure: retried, never given up (a bug shows in status)
                first.running = False
                self._failed(first, exc)
                delay = min(self.backoff_max * 6, max(0.1, delay * 2))
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            delay = 0.0
            self.last_error = ""
            self.last_progress = time.monotonic()
            with self.queue.lock:  # (the volume's: a rename sees the object either queued or on the origin, never
                # neither: between the two it moved nothing, and the renamed checkpoint lacked that file)
                self.owner.uploaded(first, "")
                self.queue.finished(first)

    def _failed(self, e: QueueEntry, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{e.kind} {e.key}: {exc}"
        e.error = str(exc)
        safely(lambda: CHECKPOINT_FAILURES.labels(result_of(exc)).inc())
        log.warning("upload of %s/%s failed, trying again: %s", self.url, e.key, exc)

    def _give_up(self, first: QueueEntry, reason: str) -> None:
        """``first`` cannot succeed (a lost commit race: with the checkpoint's other entries): failed for good, their
        bytes stay in the volume's tree."""
        log.error("%s/%s: %s; its files stay on this node only", self.url, first.key, reason)
        name = first.key
        in_it = self.queue.pending(lambda e: e is not first and (e.kind.makes_object or e.kind is EntryKind.COMMIT)
                                   and under(e.key, name))
        for e in [first, *in_it]:
            task = self._prepared.pop(e.seq, None)
            if task is not None:
                task.cancel()
            self.queue.finished(e, failed=reason)
            self.owner.uploaded(e, reason)
        self.last_error = reason

    async def _abort_leftovers(self) -> None:
        """Multipart uploads a previous process began are dropped: their entries upload again from the start.
        They are found by listing the keys the journal says uploads were asked for (the process may have died
        before it heard an upload's id): every unfinished upload of such a key goes (another writer's of the same
        name, if any, fails to complete and is begun again by that writer)."""
        for e in self.queue.pending(lambda e: bool(e.begun)):
            for key in e.begun:
                url = self._url(key)
                try:
                    for upload_id in await self.writes.unfinished_multipart(url):
                        await self._abort_quietly(url, upload_id)
                except (CacheFSError, OSError) as exc:
                    log.info("could not list the unfinished uploads of %s: %s", url, exc)
            e.begun.clear()

    def _url(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    # -- one entry ----------------------------------------------------------------------------------------------
    async def _finish(self, e: QueueEntry) -> None:
        if e.kind is EntryKind.PUT:
            started = time.monotonic()
            if e.size > self.part_size:
                await self._complete(e)
            else:
                self._start(e)
                async with self._memory(e.size):
                    data = await asyncio.to_thread(_pread, self.owner.snapshot(e.snap), 0, e.size)
                    e.etag = await self.writes.put(self._url(e.key), data)
            seconds = time.monotonic() - started
            self.rate = e.size / seconds if seconds > 0 else 0.0
            safely(lambda: CHECKPOINT_UPLOADED_BYTES.inc(e.size))
            return
        self._start(e)
        if e.kind is EntryKind.COPY:
            etag = self.owner.origin_etag(e.src)
            try:
                e.etag = await self.writes.copy(self._url(e.src), self._url(e.key), e.size, if_match=etag)
            except (StaleObjectError, ObjectNotFoundError):
                # (a renamed temporary name another writer used too: copy only the object this volume put there)
                if done := await self._copied_before(e.key, etag):
                    e.etag = done
                    return
                e.running = False
                raise _SourceReplaced(etag) from None
        elif e.kind is EntryKind.DELETE:
            await self.writes.delete(self._url(e.key))
        elif e.kind is EntryKind.CLAIM:
            await commits.claim(self.writes, self.source, self._url(e.key), self.writer)
        elif e.kind is EntryKind.COMMIT:
            await commits.write_record(self.writes, self.source, self._url(e.key), self.writer)

    def _start(self, e: QueueEntry) -> None:
        """``e`` is going to the origin now, if it is still the queue's head (see WriteQueue.start)."""
        if not self.queue.start(e):
            raise _Renamed

    async def _copied_before(self, key: str, etag: str) -> str:
        """The ETag of ``key`` if it is already the copy of the object pinned as ``etag`` (a copy a daemon made
        and died before recording, its source deleted since): the copy is done. Else ''."""
        if not etag:
            return ""
        try:
            there = await self.source.stat(self._url(key))
        except ObjectNotFoundError:
            return ""
        return there.version if there.version == etag else ""

    async def _complete(self, e: QueueEntry) -> None:
        task = self._prepared.get(e.seq)
        if task is None:
            task = self._prepared[e.seq] = asyncio.ensure_future(self._prepare(e, e.key))
        try:
            key, upload_id, etags = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and not self._stopping:
                raise _Renamed from None
            raise
        except BaseException:
            self._prepared.pop(e.seq, None)  # (failed: begun again at the next try)
            raise
        self._start(e)
        if key != e.key:  # renamed in the instant its last part went up
            self._prepared.pop(e.seq, None)
            e.running = False
            await self._abort_quietly(self._url(key), upload_id)
            raise _Renamed
        e.etag = await self.writes.complete_multipart(self._url(e.key), upload_id, etags)
        self._prepared.pop(e.seq, None)

    async def _prepare(self, e: QueueEntry, key: str) -> tuple[str, str, list[str]]:
        """Upload every part of ``e``'s snapshot under ``key``; (key, upload id, part ETags). Nothing is visible
        until the upload is completed."""
        url = self._url(key)
        self.queue.multipart_begins(e, key)
        upload_id = await self.writes.start_multipart(url)
        try:
            starts = range(0, e.size, self.part_size)
            etags = await asyncio.gather(*(self._part(e.snap, e.size, url, upload_id, n, s) for n, s in enumerate(starts, 1)))
        except BaseException:
            await asyncio.shield(self._abort_quietly(url, upload_id))
            raise
        return key, upload_id, list(etags)

    async def _abort_quietly(self, url: str, upload_id: str) -> None:
        try:
            await self.writes.abort_multipart(url, upload_id)
        except (CacheFSError, OSError) as exc:
            log.info("could not abort the upload of %s: %s", url, exc)

    async def _part(self, snap: int, total: int, url: str, upload_id: str, number: int, start: int) -> str:
        async with self._parts:
            size = min(self.part_size, total - start)
            async with self._memory(size):
                data = await asyncio.to_thread(_pread, self.owner.snapshot(snap), start, size)
                return await self.writes.put_part(url, upload_id, number, data)

    @contextlib.asynccontextmanager
    async def _memory(self, size: int) -> AsyncIterator[None]:
        """``size`` bytes of the memory budget, held while a body is read and sent."""
        if self.budget is None:
            yield
            return
        async with await self.budget.take(size):
            yield


class _Renamed(Exception):
    """The entry is no longer the queue's head (a rename moved it, a claim went before it), or its parts went up
    under a name it no longer has."""


class _SourceReplaced(Exception):
    """A copy's source no longer has the ETag the volume knew it by."""

    def __init__(self, etag: str) -> None:
        super().__init__(etag)
        self.etag = etag


def _pread(path: str, start: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        out = os.pread(fd, size, start)
    finally:
        os.close(fd)
    if len(out) != size:
        raise OSError(f"{path}: snapshot holds {start + len(out)} bytes, {start + size} were journalled")
    return out

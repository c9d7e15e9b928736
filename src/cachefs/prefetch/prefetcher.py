"""The prefetcher: one bounded queue of work to fetch ahead of readers, on the event loop.

Read paths know what comes next (a sequential reader's window of blocks, the files after a miss in a directory,
the rest of a mirror pack, a job's published epoch order); they hand the prefetcher :class:`Hint`\\ s. Each hint
names its work by a key, says how much memory it needs, and carries the coroutine function that fetches it. The
prefetcher keeps them in arrival order, at most ``max_queued``, and

* **de-duplicates**: a hint whose key is queued or running is dropped (a reader that keeps asking for the same
  window costs nothing);
* **uses spare memory only**: a hint runs once its bytes fit in the memory budget with no reader waiting for room
  (:meth:`~cachefs.node.budget.MemoryBudget.try_take`); until then it waits in the queue, and the queue waits for
  memory to come back;
* **runs at most** ``max_running`` at a time: the origin's parallelism, not more;
* **comes after readers**: it runs each hint as read-ahead (:mod:`cachefs.node.speculation`), so the origin funnel
  gives a reader's GET the next slot and holds small read-ahead GETs to what the origin takes without slowing.

Jobs (``cachefs prefetch``) use :meth:`Prefetcher.run_job` instead: every hint runs, at the job's concurrency,
taking memory as demand reads do, and the job hears how each one ended. Both are counted per kind
(:attr:`Prefetcher.counts`), so read-ahead is counted in one place.

The prefetcher never decides what to fetch and never touches the cache: it schedules work handed to it, as
:class:`~cachefs.node.disk_jobs.DiskJobs` runs disk work and :class:`~cachefs.node.flight.SingleFlight` shares
fetches (JuiceFS's ``pkg/chunk/prefetch.go`` is the same shape: a bounded queue, key de-duplication, workers).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field

from cachefs.node import speculation
from cachefs.node.budget import MemoryBudget, Reservation

__all__ = ["Hint", "PrefetchCounts", "Prefetcher"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Hint:
    """Work to fetch ahead of readers: its de-duplication ``key``, the memory it needs (``nbytes``; 0: it takes
    its own), its ``kind`` (``sequential``, ``directory``, ``mirror``, ``order``, ``job``: what it is counted
    under), and ``fetch``, called with the memory reserved for it (which it must release, or hand on)."""

    key: Hashable
    nbytes: int
    kind: str
    fetch: Callable[[Reservation | None], Awaitable[object]]


@dataclass
class PrefetchCounts:
    """Hints per kind: offered and taken into the queue, started, failed, dropped (queue full or a duplicate);
    bytes started."""

    offered: dict[str, int] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    started_bytes: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def add(table: dict[str, int], kind: str, n: int = 1) -> None:
        table[kind] = table.get(kind, 0) + n


class Prefetcher:
    """Call from the event loop, except :meth:`offer_threadsafe`."""

    def __init__(self, memory: MemoryBudget, *, max_running: int = 64, max_queued: int = 4096) -> None:
        self.memory = memory
        self.max_running, self.max_queued = max_running, max_queued
        self._queue: OrderedDict[Hashable, Hint] = OrderedDict()
        self._running: dict[Hashable, asyncio.Future] = {}
        self._pump: asyncio.Task | None = None
        self._room = asyncio.Event()  # a running hint finished
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        self.counts = PrefetchCounts()
        self._outstanding = 0  # bytes of the hints queued or running

    def __contains__(self, key: Hashable) -> bool:
        return key in self._queue or key in self._running

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def outstanding_bytes(self) -> int:
        """Bytes of the read-ahead queued or running: what it will bring to the disk soon (read-ahead budgets it)."""
        return self._outstanding

    # -- read-ahead ---------------------------------------------------------------------------------------------
    def offer(self, hints: Iterable[Hint]) -> int:
        """Queue ``hints`` (in order); how many were taken. A hint already queued or running, or one past a full
        queue, is dropped."""
        if self.closing:
            return 0
        self.loop = asyncio.get_running_loop()
        taken = 0
        for hint in hints:
            self.counts.add(self.counts.offered, hint.kind)
            if hint.key in self._queue or hint.key in self._running or len(self._queue) >= self.max_queued:
                self.counts.add(self.counts.dropped, hint.kind)
                continue
            self._queue[hint.key] = hint
            self._outstanding += hint.nbytes
            taken += 1
        if taken and (self._pump is None or self._pump.done()):
            self._pump = asyncio.ensure_future(self._run_queue())
        return taken

    def offer_threadsafe(self, hints: list[Hint]) -> None:
        """:meth:`offer` from another thread (a FUSE thread serving local reads); nothing before the loop ran."""
        loop = self.loop
        if loop is not None and not loop.is_closed() and not self.closing:
            loop.call_soon_threadsafe(self.offer, hints)

    async def _run_queue(self) -> None:
        while self._queue and not self.closing:
            if len(self._running) >= self.max_running:
                self._room.clear()
                await self._room.wait()
                continue
            key, hint = next(iter(self._queue.items()))
            held = self.memory.try_take(hint.nbytes) if hint.nbytes else None
            if hint.nbytes and held is None:
                await self.memory.released()  # spare memory only: wait until some comes back
                continue
            del self._queue[key]
            self._start(hint, held)

    def _start(self, hint: Hint, held: Reservation | None) -> None:
        self.counts.add(self.counts.started, hint.kind)
        self.counts.add(self.counts.started_bytes, hint.kind, hint.nbytes)
        task = asyncio.ensure_future(self._fetch(hint.fetch, held))
        self._running[hint.key] = task

        def done(t: asyncio.Future, key: Hashable = hint.key, kind: str = hint.kind, nbytes: int = hint.nbytes) -> None:
            if self._running.get(key) is t:
                del self._running[key]
                self._outstanding -= nbytes
            self._room.set()
            if not t.cancelled() and t.exception() is not None:
                self.counts.add(self.counts.failed, kind)
                log.debug("prefetch of %r failed: %s", key, t.exception())

        task.add_done_callback(done)

    @staticmethod
    async def _fetch(fetch: Callable[[Reservation | None], Awaitable[object]], held: Reservation | None) -> object:
        try:
            with speculation.speculating():  # (the origin funnel serves readers before it)
                return await fetch(held)
        finally:
            if held is not None:
                await held.release()  # (a no-op if the fetch released it or handed it on and it was released)

    # -- jobs ---------------------------------------------------------------------------------------------------
    async def run_job(self, hints: Iterable[Hint], *, concurrency: int
                      ) -> AsyncGenerator[tuple[Hint, BaseException | None], None]:
        """Run every hint, ``concurrency`` at a time, and yield each with how it ended (None: done). Hints take
        their own memory as demand reads do. Stopping the iteration cancels what still runs."""
        pending = iter(hints)
        running: dict[asyncio.Future, Hint] = {}

        def start_next() -> bool:
            for hint in pending:
                self.counts.add(self.counts.offered, hint.kind)
                self.counts.add(self.counts.started, hint.kind)
                running[asyncio.ensure_future(hint.fetch(None))] = hint
                return True
            return False

        while len(running) < max(1, concurrency) and start_next():
            pass
        try:
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    hint = running.pop(task)
                    exc = None if task.cancelled() else task.exception()
                    if exc is not None:
                        self.counts.add(self.counts.failed, hint.kind)
                    start_next()
                    yield hint, exc
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    # -- shutdown -----------------------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Wait until the queue is empty and nothing runs."""
        while self._queue or self._running:
            if self._running:
                await asyncio.gather(*list(self._running.values()), return_exceptions=True)
            elif self._pump is not None and not self._pump.done():
                await asyncio.wait([self._pump], timeout=0.05)
            else:
                break

    def stop(self) -> list[asyncio.Future]:
        """Stop taking hints, forget the queue; the work running (for the caller to cancel and await)."""
        self.closing = True
        self._outstanding -= sum(h.nbytes for h in self._queue.values())
        self._queue.clear()
        runs = list(self._running.values())
        if self._pump is not None:
            runs.append(self._pump)
        return runs

"""The origin funnel: every byte a reader wants from the origin (or a mirror) passes here.

Three limits, each with its reason: bytes held in memory for fetches (:class:`~cachefs.node.budget.MemoryBudget`,
so the process stays within ``engine.memory_budget`` however many readers there are), GETs in flight
(``engine.max_concurrent_fetches``: small files are latency-bound, many in flight fill a link), and bytes on the
wire (``engine.fetch_window``: more than the link takes only makes every GET slower).

Readers first (:mod:`cachefs.node.speculation`): a GET slot that comes free goes to a waiting reader before any
read-ahead, and read-ahead never starts while a reader waits. Small read-ahead GETs are held to what the origin
takes without slowing down (:class:`AheadLimit`): an origin bound by its CPU (a server beside us on two cores)
answers every GET later the more are in flight, and a reader's own GET would wait behind the read-ahead queued
in it; an origin bound by its round trip (10 ms away) answers as fast with forty in flight as with one, and
read-ahead fills the link.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from cachefs.node import speculation
from cachefs.node.budget import MemoryBudget, Reservation

__all__ = ["AheadLimit", "OriginFunnel"]

#: GETs up to this size feed the read-ahead limit and are held to it: their time is the origin's round trip
#: and its queue, not the transfer.
SMALL_GET = 256 * 1024


class AheadLimit:
    """How many small GETs may be in flight when read-ahead starts one. The least time a GET takes is measured on
    the GETs that found at most one other in flight; the limit shrinks as GETs take longer than that (they queue at
    the origin) and grows by one while they do not: ``limit × least / recent + 1``, smoothed (the delay-gradient
    rule of TCP Vegas). An origin bound by its CPU settles near two in flight; one bound by its round trip
    grows to ``most``."""

    #: Seconds over which the least GET time is remembered (an origin that got slower for good is measured
    #: afresh within two of them, if GETs alone were seen meanwhile).
    WINDOW = 5.0

    def __init__(self, most: int) -> None:
        self.most = most
        self.limit = float(max(1, most // 4))
        self._least = float("inf")  # over the last window that saw a GET alone
        self._least_now = float("inf")  # over the current one
        self._window_start = time.monotonic()

    def note(self, seconds: float, in_flight: int) -> None:
        """One small GET took ``seconds``, with ``in_flight`` GETs in flight (itself included) when it started."""
        now = time.monotonic()
        if now - self._window_start > self.WINDOW:
            if self._least_now != float("inf"):
                self._least = self._least_now
            self._least_now, self._window_start = float("inf"), now
        if in_flight <= 2:
            self._least_now = min(self._least_now, seconds)
        least = min(self._least, self._least_now)
        if least == float("inf"):
            return
        wanted = self.limit * least / max(seconds, 1e-6) + 1
        self.limit = min(float(self.most), max(1.0, 0.8 * self.limit + 0.2 * wanted))


class OriginFunnel:
    def __init__(self, memory_budget: int, max_concurrent: int, window: int) -> None:
        self.memory = MemoryBudget(memory_budget)
        self._wire = MemoryBudget(window)
        self.max_concurrent = max_concurrent
        self.ahead_limit = AheadLimit(max_concurrent)
        self.in_flight = 0
        self._readers: collections.deque[asyncio.Future] = collections.deque()
        self._ahead: collections.deque[tuple[asyncio.Future, speculation.Speculation, bool]] = collections.deque()

    async def hold(self, nbytes: int) -> Reservation:
        """Memory for ``nbytes`` of fetched data, waiting for room."""
        return await self.memory.take(nbytes)

    def try_hold(self, nbytes: int) -> Reservation | None:
        """Memory for ``nbytes`` if there is room now (read-ahead uses spare room only)."""
        return self.memory.try_take(nbytes)

    async def get(self, source, url: str, version: str, start: int, length: int,
                  wanted: Callable[[], bool] | None = None) -> bytes | bytearray:
        """``length`` bytes of ``url`` (``version``) at ``start``, within the GET and wire limits, readers first.
        The caller holds memory for them. ``wanted``: for read-ahead, whether it is still worth its GET once a slot
        comes (a while after it was planned): :class:`~cachefs.node.speculation.NotWanted` if not."""
        small = length <= SMALL_GET
        spec = speculation.current()
        await self._slot(spec, small)
        try:
            if spec is not None and not spec.promoted and wanted is not None and not wanted():
                raise speculation.NotWanted(url)
            async with await self._wire.take(length):
                started, in_flight = time.monotonic(), self.in_flight
                data = await source.read(url, version, start, start + length)
                if small:
                    self.ahead_limit.note(time.monotonic() - started, in_flight)
                return data
        finally:
            self.in_flight -= 1
            self._wake()

    # -- GET slots, readers first -------------------------------------------------------------------------------
    def _ahead_may_start(self, small: bool) -> bool:
        return not self._readers and self.in_flight < (int(self.ahead_limit.limit) if small else self.max_concurrent)

    async def _slot(self, spec: speculation.Speculation | None, small: bool) -> None:
        if spec is None:
            if self.in_flight < self.max_concurrent and not self._readers:
                self.in_flight += 1
                return
            await self._wait(self._readers, asyncio.get_running_loop().create_future())
            return
        if self._ahead_may_start(small) and not self._ahead:
            self.in_flight += 1
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, spec, small)
        self._ahead.append(entry)

        def promoted() -> None:  # a reader came for it: it waits among the readers now
            if not fut.done():
                self._ahead.remove(entry)
                self._readers.append(fut)
                self._wake()

        spec.on_promote(promoted)
        try:
            await self._wait(None, fut)
        finally:
            spec.forget(promoted)

    async def _wait(self, queue: collections.deque | None, fut: asyncio.Future) -> None:
        """Wait for ``fut``, which :meth:`_wake` resolves with the slot taken for us (queued on ``queue``)."""
        if queue is not None:
            queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # given a slot as we were cancelled: hand it on
                self.in_flight -= 1
                self._wake()
            else:
                self._discard(fut)
                self._wake()  # (read-ahead may have waited behind this reader)
            raise

    def _discard(self, fut: asyncio.Future) -> None:
        if fut in self._readers:
            self._readers.remove(fut)
        for entry in self._ahead:
            if entry[0] is fut:
                self._ahead.remove(entry)
                break

    def _wake(self) -> None:
        while self.in_flight < self.max_concurrent and self._readers:
            fut = self._readers.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)
        while self._ahead and self._ahead_may_start(self._ahead[0][2]):
            fut = self._ahead.popleft()[0]
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)

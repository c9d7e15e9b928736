"""A hard ceiling on bytes held for in-flight fetches, shared by every reader and the prefetcher.

Bytes are held through a :class:`Reservation`: taken from the budget, released exactly once by whoever holds it
last (read-ahead takes one when it queues a fetch and hands it to the fetch), usable as an async context
manager.
"""

from __future__ import annotations

import asyncio

__all__ = ["MemoryBudget", "Reservation"]


class MemoryBudget:
    """``take(n)`` waits until ``n`` more bytes fit under the limit; ``try_take`` never waits, and takes only spare
    room: none while a ``take`` is waiting, so that work ahead of readers never delays a reader.

    A single request larger than the whole budget is admitted alone, so nothing can deadlock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        #: ``take`` calls waiting for room now.
        self.waiting = 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit or self.used == 0

    def _add(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    async def take(self, n: int) -> Reservation:
        """Hold ``n`` bytes, waiting for room."""
        if self.waiting == 0 and self._fits(n):
            self._add(n)
            return Reservation(self, n)
        cond = self._condition()
        self.waiting += 1
        try:
            async with cond:
                await cond.wait_for(lambda: self._fits(n))
                self._add(n)
        finally:
            self.waiting -= 1
        return Reservation(self, n)

    def try_take(self, n: int) -> Reservation | None:
        """Hold ``n`` bytes if they fit now and no ``take`` is waiting (read-ahead uses spare room only)."""
        if self.waiting or not self._fits(n):
            return None
        self._add(n)
        return Reservation(self, n)

    async def released(self) -> None:
        """Wait until some bytes are given back."""
        cond = self._condition()
        async with cond:
            await cond.wait()

    async def _give_back(self, n: int) -> None:
        cond = self._condition()
        async with cond:
            self.used -= n
            cond.notify_all()


class Reservation:
    """``size`` bytes held against a :class:`MemoryBudget` until :meth:`release` (once; later calls do nothing)."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: MemoryBudget, size: int) -> None:
        self._budget: MemoryBudget | None = budget
        self.size = size

    async def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            await budget._give_back(self.size)

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.release()

"""A hard ceiling on bytes held for in-flight fetches, shared by every reader and the prefetcher.

Bytes are held through a :class:`Reservation`: taken from the budget, released exactly once by whoever holds it
last (read-ahead takes one when it queues a fetch and hands it to the fetch), usable as an async context
manager.
"""

from __future__ import annotations

import asyncio

__all__ = ["MemoryBudget", "Reservation"]


class MemoryBudget:
    """``take(n)`` waits until ``n`` more bytes fit under the limit; ``try_take`` never waits.

    A single request larger than the whole budget is admitted alone, so nothing can deadlock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
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
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self._fits(n))
            self._add(n)
        return Reservation(self, n)

    def try_take(self, n: int) -> Reservation | None:
        """Hold ``n`` bytes if they fit now (read-ahead uses spare room only)."""
        if not self._fits(n):
            return None
        self._add(n)
        return Reservation(self, n)

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

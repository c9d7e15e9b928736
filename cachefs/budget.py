"""A hard ceiling on bytes held for in-flight fetches, shared by every reader and the prefetcher."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

__all__ = ["MemoryBudget"]


class MemoryBudget:
    """``reserve(n)`` waits until ``n`` more bytes fit under the limit; ``try_reserve`` never waits.

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

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    async def acquire(self, n: int) -> None:
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self._fits(n))
            self._take(n)

    @asynccontextmanager
    async def reserve(self, n: int):
        await self.acquire(n)
        try:
            yield
        finally:
            await self._release(n)

    def try_reserve(self, n: int) -> bool:
        if not self._fits(n):
            return False
        self._take(n)
        return True

    async def release(self, n: int) -> None:
        await self._release(n)

    async def _release(self, n: int) -> None:
        cond = self._condition()
        async with cond:
            self.used -= n
            cond.notify_all()

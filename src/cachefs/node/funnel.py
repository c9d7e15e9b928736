"""The origin funnel: every byte a reader wants from the origin (or a mirror) passes here.

Three limits, each with its reason: bytes held in memory for fetches (:class:`~cachefs.node.budget.MemoryBudget`,
so the process stays within ``engine.memory_budget`` however many readers there are), GETs in flight
(``engine.max_concurrent_fetches``: small files are latency-bound, many in flight fill a link), and bytes on the
wire (``engine.fetch_window``: more than the link takes only makes every GET slower).
"""

from __future__ import annotations

import asyncio

from cachefs.node.budget import MemoryBudget, Reservation

__all__ = ["OriginFunnel"]


class OriginFunnel:
    def __init__(self, memory_budget: int, max_concurrent: int, window: int) -> None:
        self.memory = MemoryBudget(memory_budget)
        self._wire = MemoryBudget(window)
        self._max_concurrent = max_concurrent
        self._slots: asyncio.Semaphore | None = None  # made on the loop that uses it

    async def hold(self, nbytes: int) -> Reservation:
        """Memory for ``nbytes`` of fetched data, waiting for room."""
        return await self.memory.take(nbytes)

    def try_hold(self, nbytes: int) -> Reservation | None:
        """Memory for ``nbytes`` if there is room now (read-ahead uses spare room only)."""
        return self.memory.try_take(nbytes)

    async def get(self, source, url: str, version: str, start: int, length: int) -> bytes | bytearray:
        """``length`` bytes of ``url`` (``version``) at ``start``, within the GET and wire limits. The caller
        holds memory for them."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_concurrent)
        async with self._slots, await self._wire.take(length):
            return await source.read(url, version, start, start + length)

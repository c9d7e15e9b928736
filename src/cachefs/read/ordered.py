"""Fetching ahead in a declared order: when a reader opens a file, what the published orders of its dataset say
comes next is handed to the prefetcher (cachefs.prefetch.orders says what, each read strategy how)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable

from cachefs.base.types import Entry, object_key
from cachefs.manifest.dataset import Dataset
from cachefs.node.budget import Reservation
from cachefs.prefetch.orders import OrderBook
from cachefs.prefetch.prefetcher import Prefetcher
from cachefs.read.base import ReadStrategy

__all__ = ["OrderedLookahead"]


class OrderedLookahead:
    """``budget``: bytes to keep on their way past a reader in each order (0: off)."""

    def __init__(self, orders: OrderBook, prefetcher: Prefetcher, strategy: Callable[[Entry], ReadStrategy],
                 budget: int) -> None:
        self.orders, self.prefetcher, self.strategy, self.budget = orders, prefetcher, strategy, budget

    def opened(self, ds: Dataset, entry: Entry) -> None:
        """A reader opens ``entry`` (any thread): fetch what comes next after it."""
        if not self.budget:
            return

        def size_to_fetch(path: str) -> int | None:
            try:
                e = ds.file(path)
            except OSError:
                return None
            return None if self.strategy(e).cached_bytes(ds, e, object_key(ds.ref.id, e.path, e.version)) >= e.size else e.size

        hints = []
        for path, still_ahead in self.orders.opened(ds.ref.id, entry.path, self.budget, size_to_fetch):
            e = ds.file(path)
            hints += [dataclasses.replace(h, fetch=functools.partial(_if_ahead, still_ahead, h.fetch))
                      for h in self.strategy(e).ahead_hints(ds, e)]
        if not hints:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.prefetcher.offer_threadsafe(hints)  # (a FUSE thread)
        else:
            self.prefetcher.offer(hints)


async def _if_ahead(still_ahead: Callable[[], bool], fetch: Callable[[Reservation | None], Awaitable[object]],
                    held: Reservation | None) -> None:
    """Run a fetch ahead unless its reader has passed the file meanwhile (it read it itself: a second fetch would
    only be thrown away). The prefetcher releases ``held`` either way."""
    if still_ahead():
        await fetch(held)

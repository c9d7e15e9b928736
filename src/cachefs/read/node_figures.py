"""The read path's figures leave the engine here: bytes served (by kind and result, by tier), corrupt reads,
fallbacks, refused disk writes and memory into the Prometheus metrics, and the bytes by tier into the cache
directory's counters (what ``cachefs status`` shows, whichever process counted them)."""

from __future__ import annotations

import logging

from cachefs.base import metrics
from cachefs.base.errors import CacheFSError
from cachefs.index.counters import NodeCounters
from cachefs.node.budget import MemoryBudget
from cachefs.node.read_stats import ReadStats
from cachefs.node.space import DiskSpace
from cachefs.prefetch.orders import OrderBook
from cachefs.tiers import TierCounts

__all__ = ["NodeFigures"]

log = logging.getLogger(__name__)


class NodeFigures:
    """Publishes what grew since the last :meth:`flush` (called from the engine's statistics thread)."""

    def __init__(self, stats: ReadStats, tiers: TierCounts, counters: NodeCounters, space: DiskSpace,
                 budget: MemoryBudget, orders: OrderBook) -> None:
        self.stats, self.tiers, self.counters, self.space, self.budget, self.orders = (
            stats, tiers, counters, space, budget, orders)
        self._deltas = metrics.Deltas()
        self._counted: dict[str, int] = {}

    def flush(self) -> None:
        self._push_metrics()
        self._count()

    def _count(self) -> None:
        """Bytes served by tier and corrupt reads since the last flush, into the index."""
        served = dict(self.stats.served)
        tiers, _ = self.tiers.snapshot()
        now = {**{f"tier:{k}": n for k, n in tiers.items()},
               "tier:local": sum(n for (_k, result), n in served.items() if result == "hit"),
               **{f"corrupt:{k}": n for k, n in dict(self.stats.corrupt).items()}}
        deltas = {k: n - self._counted.get(k, 0) for k, n in now.items()}
        try:
            self.counters.add(deltas)
            self._counted = now
        except CacheFSError as exc:  # (a full disk: counted at the next flush)
            log.debug("tier bytes not recorded: %s", exc)

    def _push_metrics(self) -> None:
        push = self._deltas.push
        served = dict(self.stats.served)
        for (kind, result), n in served.items():
            push(metrics.READ_BYTES, (kind, result), n)
        for kind, n in dict(self.stats.corrupt).items():
            push(metrics.CORRUPT_READS, (kind,), n)
        push(metrics.TIER_BYTES, ("local",), sum(n for (_k, result), n in served.items() if result == "hit"))
        tiers, fallbacks = self.tiers.snapshot()
        for tier, n in tiers.items():
            push(metrics.TIER_BYTES, (tier,), n)
        for (tier, reason), n in fallbacks.items():
            push(metrics.TIER_FALLBACKS, (tier, reason), n)
        push(metrics.DISK_REFUSED, (), self.space.refused)
        metrics.safely(self._gauges)

    def _gauges(self) -> None:
        metrics.MEMORY_RESERVED.set(self.budget.used)
        metrics.MEMORY_BUDGET.set(self.budget.limit)
        files, nbytes, seconds = self.orders.ahead()
        metrics.ORDER_AHEAD_FILES.set(files)
        metrics.ORDER_AHEAD_BYTES.set(nbytes)
        metrics.ORDER_AHEAD_SECONDS.set(seconds)

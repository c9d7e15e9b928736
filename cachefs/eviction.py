"""Eviction: which cached objects and packs go when the cache passes its limits, and taking them out.

When cached bytes pass ``high_watermark × capacity`` or the disk's free space drops under ``min_free``, whole
objects and packs are removed until usage is under ``low_watermark × capacity`` (and, when a write asked for
room, until it fits): first those read at most once, then the rest, least recently used first within each group
(:func:`eviction_order`). An object a reader holds (any process: a shared ``flock``) is skipped; a pack goes
without waiting for readers, who read on from the unlinked file.
"""

from __future__ import annotations

import logging

from .config import Config
from .errors import CacheFullError
from .index import Index
from .index.records import ObjectRecord, PackRecord
from .open_objects import OpenObjects
from .read_stats import ReadStats
from .store import BlockStore
from .store.packs import PackStore

__all__ = ["Evictor", "eviction_order"]

log = logging.getLogger(__name__)


def eviction_order(rec: ObjectRecord | PackRecord) -> tuple[bool, float]:
    """Sort key of eviction victims ("two-touch LRU"): objects read at most once go first, oldest first, then
    objects read twice or more, oldest first. One-off scans and a dataset streamed once therefore cannot push
    out data that jobs keep coming back to; bench/eviction_bench.py measures it against LRU, FIFO and
    random (better than each on skewed and hot-plus-scan traces, close to random on pure epoch scans)."""
    return rec.hits >= 2, rec.last_access


class Evictor:
    def __init__(self, config: Config, capacity: int, min_free: int, index: Index, store: BlockStore,
                 packs: PackStore, objects: OpenObjects, stats: ReadStats) -> None:
        self.config, self.capacity, self.min_free = config, capacity, min_free
        self.index, self.store, self.packs, self.objects, self.stats = index, store, packs, objects, stats
        #: Set (epoch seconds) while a prefetch runs in this process: what was used since is not evicted, so that
        #: a selection larger than the cache fails clearly instead of evicting what it just fetched.
        self.keep_newer_than: float | None = None

    def over_limits(self) -> bool:
        total, _ = self.index.totals()
        _, free = self.store.disk_usage()
        return total > self.capacity * self.config.cache.high_watermark or free < self.min_free

    def flush_stats(self) -> None:
        """Access statistics into the index first, so that the order is current."""
        self.stats.flush(self.index, self.objects.take_access(), self.config.engine.hot_dir_half_life)

    def evict(self, *, force: bool = False, dataset: str | None = None, everything: bool = False,
              need: int = 0) -> int:
        """Evict in :func:`eviction_order` until usage is under the low watermark and ``need`` more bytes fit
        (``force``: even when under the high watermark); ``dataset`` / ``everything``: all of it that no reader
        holds. Returns the bytes freed. Blocking."""
        self.flush_stats()
        c = self.config.cache
        target = min(int(self.capacity * c.low_watermark), self.capacity - need)
        floor = max(self.min_free * 1.1, self.min_free + need)
        total, _ = self.index.totals()
        _, free = self.store.disk_usage()
        if not (force or everything or dataset) and total <= self.capacity * c.high_watermark and free >= self.min_free:
            return 0
        candidates = sorted([*self.index.objects(dataset), *((None, p) for p in self.index.packs(dataset))],
                            key=lambda kv: eviction_order(kv[1]))
        freed = 0
        keep = None if (everything or dataset) else self.keep_newer_than
        for okey, rec in candidates:
            if keep is not None and rec.last_access >= keep:
                continue
            if not (everything or dataset):
                total, _ = self.index.totals()
                _, free = self.store.disk_usage()
                if total <= target and free >= floor:
                    break
            try:
                freed += self._evict_one(okey, rec)
            except CacheFullError as exc:  # not even the index's reserve let it commit
                log.error("eviction stopped: %s", exc)
                break
        if freed:
            log.info("evicted %d bytes", freed)
        return freed

    def _evict_one(self, okey: bytes | None, rec: ObjectRecord | PackRecord) -> int:
        if okey is None:  # a pack: the index forgets it and its members, then the file goes
            freed = self.index.remove_pack(rec.dataset, rec.pack_id)
            self.packs.remove(rec.dataset, rec.pack_id)
            return freed
        if not self.objects.close_idle(okey):
            return 0  # a reader here holds it (the exclusive lock would fail anyway)
        removed: list[int] = []

        def forget() -> bool:
            removed.append(self.index.remove_object(okey))
            return True

        return sum(removed) if self.store.try_remove(okey, rec.dataset, forget) else 0

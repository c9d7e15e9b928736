"""Room on the cache disk: whether new bytes may be stored.

A write is admitted only if afterwards the cached bytes stay within the capacity *and* the file system keeps its
free-space floor. The "evict, then try once more" rule every writer follows is :meth:`cachefs.node.admission.Admission.store`,
built on this.

After a refusal the disk counts as full for :data:`FULL_BACKOFF` seconds, during which writes are refused at
once. Without that, every block a reader streams past a full disk would scan the index for eviction victims and
find none (0.45 MB/s in the issue that introduced this module, against the origin's tens of MB/s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from cachefs.base.errors import CacheFullError
from cachefs.index import Index
from cachefs.store import BlockStore

__all__ = ["FULL_BACKOFF", "DiskSpace"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds a refused write keeps the disk counted as full (no eviction scan per block meanwhile).
FULL_BACKOFF = 2.0


class DiskSpace:
    """Admission of new bytes on one cache disk: the index's cached bytes against ``capacity``, the store's file
    system against ``min_free``."""

    def __init__(self, index: Index, store: BlockStore, *, capacity: int, min_free: int, high_watermark: float,
                 low_watermark: float | None = None) -> None:
        self.index, self.store = index, store
        self.capacity, self.min_free, self.high_watermark = capacity, min_free, high_watermark
        self.low_watermark = high_watermark if low_watermark is None else low_watermark
        self._full_until = 0.0
        self._warned = False
        #: Writes refused for want of room since start (the metrics show it).
        self.refused = 0

    def room(self) -> int:
        """Bytes that may still be stored: within the capacity and above the free-space floor."""
        return self._room_below(self.capacity)

    def room_under_high(self) -> int:
        """Bytes that may be stored without passing the high watermark (so without setting eviction off) and above
        the free-space floor: all a scanned dataset is admitted into, and all read-ahead may ask for."""
        return self._room_below(int(self.capacity * self.high_watermark))

    def _room_below(self, limit: int) -> int:
        _, free = self.store.disk_usage()
        return max(0, min(limit - self.index.totals()[0], free - self.min_free))

    def admits(self, nbytes: int) -> bool:
        return nbytes <= self.room()

    def guest_room(self) -> int:
        """Bytes guest data may still take: under the low watermark (the room up to the high one is left to the
        node's own data, so guests never set eviction off) and above the free-space floor."""
        _, free = self.store.disk_usage()
        return max(0, min(int(self.capacity * self.low_watermark) - self.index.totals()[0], free - self.min_free))

    def over_limits(self) -> bool:
        """Past the high watermark, or under the free-space floor: time to evict."""
        _, free = self.store.disk_usage()
        return self.index.totals()[0] > self.capacity * self.high_watermark or free < self.min_free

    @property
    def full(self) -> bool:
        """Whether a write was refused less than FULL_BACKOFF seconds ago."""
        return time.monotonic() < self._full_until

    def try_store(self, nbytes: int, write: Callable[[], T]) -> tuple[bool, T | None]:
        """Run ``write()`` (which puts ``nbytes`` on the disk and may raise :class:`CacheFullError`) if there is
        room now, without evicting: (True, result) when decided here (written, or refused while the disk counts
        as full); (False, None) when only eviction can decide (see Admission.store)."""
        if self.full:
            self.refused += 1
            return True, None
        if not self.admits(nbytes):
            return False, None
        try:
            return True, write()
        except CacheFullError:
            return False, None

    def mark_full(self) -> None:
        self.refused += 1
        self._full_until = time.monotonic() + FULL_BACKOFF
        if not self._warned:
            self._warned = True
            log.warning("cache disk full and nothing evictable: serving from the origin without caching "
                        "(capacity %d B, free-space floor %d B)", self.capacity, self.min_free)

    def clear(self) -> None:
        """Eviction freed space or a write succeeded: try writes again."""
        self._full_until = 0.0

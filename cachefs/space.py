"""Room on the cache disk: whether new bytes may be stored, and the one "evict, then try once more" rule.

Every writer of cached bytes (blocks, packs, mirror packs) asks :meth:`DiskSpace.store` instead of writing and
handling a full disk itself. A write is admitted only if afterwards the cached bytes stay within the capacity
*and* the file system keeps its free-space floor; otherwise eviction runs once and the write is tried again.
If there is still no room, or the write itself hits ENOSPC/EDQUOT (another tenant filled the disk), the
bytes are not stored: the caller serves them from memory and the reader never sees an error.

After such a refusal the disk counts as full for :data:`FULL_BACKOFF` seconds, during which writes are
refused at once. Without that, every block a reader streams past a full disk would scan the index for
eviction victims and find none (0.45 MB/s in the issue that introduced this module, against the origin's
tens of MB/s).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import CacheFullError

__all__ = ["FULL_BACKOFF", "DiskSpace"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds a refused write keeps the disk counted as full (no eviction scan per block meanwhile).
FULL_BACKOFF = 2.0


class DiskSpace:
    """Admission of new bytes on one cache disk.

    ``used()`` gives the cached bytes (the index's total), ``disk()`` the file system's (total, free) bytes,
    ``evict(need)`` frees what eviction can (any thread) so that ``need`` more bytes fit, and returns the bytes
    freed.
    """

    def __init__(self, *, capacity: int, min_free: int, high_watermark: float, used: Callable[[], int],
                 disk: Callable[[], tuple[int, int]], evict: Callable[[int], int],
                 evict_soon: Callable[[], None] = lambda: None) -> None:
        self.capacity, self.min_free, self.high_watermark = capacity, min_free, high_watermark
        self._used, self._disk, self._evict, self._evict_soon = used, disk, evict, evict_soon
        # Limits are checked (an index read and a statvfs) every this many stored bytes rather than per write:
        # half the room between the high watermark and the capacity, so usage still never passes capacity.
        self._check_every = max(1, min(64 << 20, int(capacity * (1 - high_watermark) / 2)))
        self._stored_since_check = 0
        self._full_until = 0.0
        self._evicting = threading.Lock()
        self._warned = False
        #: Writes refused for want of room since start (the metrics and ``cachefs status`` show it).
        self.refused = 0

    def room(self) -> int:
        """Bytes that may still be stored: within the capacity and above the free-space floor."""
        _, free = self._disk()
        return max(0, min(self.capacity - self._used(), free - self.min_free))

    def admits(self, nbytes: int) -> bool:
        return nbytes <= self.room()

    def over_limits(self) -> bool:
        """Past the high watermark, or under the free-space floor: time to evict."""
        _, free = self._disk()
        return self._used() > self.capacity * self.high_watermark or free < self.min_free

    def note_stored(self, nbytes: int) -> None:
        """``nbytes`` more are on the disk: writes may go on (a full disk is over), and every so often the
        limits are checked and eviction started in the background (``evict_soon``) if they are passed."""
        self._full_until = 0.0
        self._stored_since_check += nbytes
        if self._stored_since_check >= self._check_every:
            self._stored_since_check = 0
            if self.over_limits():
                self._evict_soon()

    @property
    def full(self) -> bool:
        """Whether a write was refused less than FULL_BACKOFF seconds ago."""
        return time.monotonic() < self._full_until

    def store(self, nbytes: int, write: Callable[[], T]) -> T | None:
        """Run ``write()`` (which puts ``nbytes`` on the disk and may raise :class:`CacheFullError`) if there is
        room, evicting once if there is not; None when the bytes were not stored. Blocking: call from a thread
        (or with ``nbytes`` known to fit, see :meth:`try_store`)."""
        if self.full:
            self.refused += 1
            return None
        for attempt in (0, 1):
            if self.admits(nbytes):
                try:
                    return write()
                except CacheFullError:
                    pass
            if attempt == 0:
                self.evict(nbytes)
        self.mark_full()
        return None

    def try_store(self, nbytes: int, write: Callable[[], T]) -> tuple[bool, T | None]:
        """:meth:`store` without eviction, for the event loop: (True, result) when it was decided here
        (stored, or refused while the disk counts as full); (False, None) when only a blocking
        :meth:`store` can decide."""
        if self.full:
            self.refused += 1
            return True, None
        if not self.admits(nbytes):
            return False, None
        try:
            return True, write()
        except CacheFullError:
            return False, None

    def evict(self, need: int = 0) -> int:
        """Evict so that ``need`` more bytes fit (one eviction at a time in this process; a caller that finds
        one running waits for it); returns the bytes freed."""
        with self._evicting:
            return self._evict(need)

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

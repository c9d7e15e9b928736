"""Room for staged bytes: the staging limit with back-pressure, and the cache disk shared with the read path.

Staged bytes are those written to a volume and not yet on the origin. Past ``checkpoint.staging_limit`` a writer
waits while the upload drains; only when the upload has made no progress for ``checkpoint.stall_timeout`` does it
get ENOSPC. Below the limit, a write that the disk has no room for first asks the read cache to make room
(``make_room``: the engine's eviction, which never offers staged bytes), then drops clean copies of files already
uploaded.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from cachefs.base.errors import CacheFullError

__all__ = ["StagingRoom"]


class StagingRoom:
    """Bytes staged by one volume against its limit; the disk under ``path`` against ``min_free``."""

    def __init__(self, path: str, *, limit: int, min_free: int, stall_timeout: float, changed: threading.Condition,
                 queued: Callable[[], int], dirty: Callable[[], int], last_progress: Callable[[], float],
                 make_room: list[Callable[[int], int]] | None = None) -> None:
        self.path, self.limit, self.min_free, self.stall_timeout = path, limit, min_free, stall_timeout
        self._changed = changed  # notified whenever an upload finishes (the queue's condition)
        self._queued, self._dirty = queued, dirty
        self._last_progress = last_progress
        self._make_room = make_room or []
        #: Writers waiting for room now, and how many times one waited (status shows both).
        self.waiting = 0
        self.waits = 0

    def staged(self) -> int:
        return self._queued() + self._dirty()

    def _over(self, nbytes: int) -> bool:
        # Only closed files drain: bytes of files still open never make a writer wait (one file larger than the
        # limit would wait for ever), though they count.
        return self.staged() + nbytes > self.limit and self._queued() > 0

    def take(self, nbytes: int) -> None:
        """Return once ``nbytes`` more may be written: under the staging limit and on the disk. Blocking."""
        with self._changed:
            if self._over(nbytes):
                self.waits += 1
                self.waiting += 1
                began = time.monotonic()
                try:
                    while self._over(nbytes):
                        if time.monotonic() - max(began, self._last_progress()) > self.stall_timeout:
                            raise CacheFullError(
                                f"checkpoint staging is full ({self.staged()} of {self.limit} bytes) and the upload "
                                f"has made no progress for {self.stall_timeout:.0f}s (see cachefs status)")
                        self._changed.wait(timeout=1.0)
                finally:
                    self.waiting -= 1
        for make_room in self._make_room:  # the read cache first, then clean copies of uploaded files
            if self._free() - self.min_free >= nbytes:
                return
            make_room(nbytes)
        if self._free() - self.min_free < nbytes:
            raise CacheFullError(f"the cache disk has no room for {nbytes} more staged bytes, and the read cache "
                                 "has nothing left to give")

    def _free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

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
from collections.abc import Callable, Sequence
from typing import Protocol

from cachefs.base.errors import CacheFullError
from cachefs.write.services import RoomMaker

__all__ = ["StagedBytes", "StagingRoom"]


class StagedBytes(Protocol):
    """What the staging room needs of its volume."""

    def queued_bytes(self) -> int:
        """Bytes of closed files waiting for their upload."""

    def dirty_bytes(self) -> int:
        """Bytes written to open files since their last close."""

    def last_progress(self) -> float:
        """When (``time.monotonic``) the upload last made progress."""

    def wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``done()`` (checked whenever the queue changes); whether it is."""


class StagingRoom:
    """Bytes ``staged`` by one volume against its limit; the disk under ``path`` against ``min_free``, made room on by
    ``make_room`` in order."""

    def __init__(self, path: str, *, limit: int, min_free: int, stall_timeout: float, staged: StagedBytes,
                 make_room: Sequence[RoomMaker] = ()) -> None:
        self.path, self.limit, self.min_free, self.stall_timeout = path, limit, min_free, stall_timeout
        self._staged = staged
        self._make_room = list(make_room)
        self._counting = threading.Lock()
        #: Writers waiting for room now, and how many times one waited (status shows both).
        self.waiting = 0
        self.waits = 0

    def staged(self) -> int:
        return self._staged.queued_bytes() + self._staged.dirty_bytes()

    def _over(self, nbytes: int) -> bool:
        # Only closed files drain: bytes of files still open never make a writer wait (one file larger than the
        # limit would wait for ever), though they count.
        return self.staged() + nbytes > self.limit and self._staged.queued_bytes() > 0

    def take(self, nbytes: int) -> None:
        """Return once ``nbytes`` more may be written: under the staging limit and on the disk. Blocking."""
        if self._over(nbytes):
            with self._counting:
                self.waits += 1
                self.waiting += 1
            began = time.monotonic()
            try:
                while not self._staged.wait_until(lambda: not self._over(nbytes), timeout=1.0):
                    if time.monotonic() - max(began, self._staged.last_progress()) > self.stall_timeout:
                        raise CacheFullError(
                            f"checkpoint staging is full ({self.staged()} of {self.limit} bytes) and the upload "
                            f"has made no progress for {self.stall_timeout:.0f}s (see cachefs status)")
            finally:
                with self._counting:
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

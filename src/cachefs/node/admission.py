"""Admission: whether new bytes go onto the cache disk, and the one "make room, then try once more" rule every
writer of cached bytes follows (:meth:`Admission.store`).

A write is admitted if the disk has room (:class:`~cachefs.node.space.DiskSpace`); if not, eviction makes room
once (:meth:`~cachefs.node.eviction.Eviction.make_room`) and the write is tried again; refused, the disk counts as
full for a while and the bytes are served uncached.

A dataset read as an epoch scan (:mod:`.scan`) is admitted differently: only under the high watermark, into room
taken from guest data and from what nobody used since the scan began, never from the scan's own bytes
(:meth:`~cachefs.node.eviction.Eviction.make_room_for_scan`). So the part of it that fits stays from one epoch to
the next, and the rest passes through uncached (a hit ratio of the fraction that fits, where LRU gets 15 % at
half). Bytes fetched ahead of a reader may also take the room of the scan's files its readers have passed.

Guest data (another group member owns it) is admitted only under the low watermark, into room made by evicting
other guest data: never what the node owns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from cachefs.base.errors import CacheFullError
from cachefs.node.eviction import Eviction
from cachefs.node.eviction_policy import NextUse
from cachefs.node.scan_view import ScanView
from cachefs.node.space import FULL_BACKOFF, DiskSpace

__all__ = ["Admission"]

T = TypeVar("T")


class Admission:
    """``next_use``: the node's declared read orders (what their readers have passed this epoch), if any."""

    def __init__(self, space: DiskSpace, eviction: Eviction, scans: ScanView, next_use: NextUse | None = None) -> None:
        self.space, self.eviction, self.scans, self.next_use = space, eviction, scans, next_use
        self.capacity = space.capacity
        self._guests_full_until = 0.0  # (guest writes refused at once until then: no scan of guests per block)
        self._scan_full_until: dict[str, float] = {}  # a scan's writes refused at once until then
        self._ahead_full_until: dict[str, float] = {}  # a scan's reading ahead paused until then (ahead_refusing)

    # -- what writers ask first -----------------------------------------------------------------------------
    def scanning(self, dataset: str) -> bool:
        return self.scans.scanning(dataset)

    def scan_refusing(self, dataset: str) -> bool:
        """Whether a scanned dataset's writes are being refused at once (it has no room left)."""
        return time.monotonic() < self._scan_full_until.get(dataset, 0.0)

    def ahead_refusing(self, dataset: str) -> bool:
        """Whether reading ahead in a scanned dataset is paused: the disk refused bytes read ahead of its readers
        (nothing passed yet to make room), and what the disk does not keep waits in memory among the readers' own
        misses, which can push it out before its reader comes (it is then fetched twice)."""
        return time.monotonic() < self._ahead_full_until.get(dataset, 0.0)

    def room(self, dataset: str, need: int) -> int:
        """Bytes ``dataset``'s writes may take now, after making room for ``need`` as :meth:`store` would; 0 while
        its writes are refused. Blocking: a disk thread."""
        since = self.scans.since(dataset)
        if since is None:
            if not self.space.full and not self.space.admits(need):
                self.eviction.make_room(need)
            return 0 if self.space.full else self.space.room()
        if self.scan_refusing(dataset):
            return 0
        limit, floor = self.eviction.high - need, self.eviction.floor_for(need)
        if not self.eviction.under(limit, floor):
            self.eviction.make_room_for_scan(dataset, since, limit, floor)
        room = self.space.room_under_high()
        if room < need:
            self._scan_full_until[dataset] = time.monotonic() + FULL_BACKOFF
        return room

    def guest_room(self, need: int) -> int:
        """Bytes guest data may take now, after evicting other guest data for ``need``. Blocking: a disk thread."""
        if self.space.guest_room() < need:
            self.eviction.make_guest_room(need)
        return self.space.guest_room()

    # -- writing (blocking: a disk thread) -------------------------------------------------------------------
    def store(self, nbytes: int, write: Callable[[], T], dataset: str | None = None, *, ahead: bool = False
              ) -> T | None:
        """Run ``write()`` (which puts ``nbytes`` on the disk and may raise :class:`CacheFullError`) if there is
        room, evicting once if there is not; None when the bytes were not stored. ``dataset``: whose bytes they
        are (a scanned dataset's are admitted as the module says). ``ahead``: bytes fetched ahead of a reader that
        has not read them yet."""
        if dataset is not None:
            since = self.scans.since(dataset)
            if since is not None:
                return self._store_for_scan(dataset, since, nbytes, write, ahead)
        if self.space.full:
            self.space.refused += 1
            return None
        stored, value = _write_making_room_once(lambda: self.space.admits(nbytes),
                                                lambda: self.eviction.make_room(nbytes), write)
        if not stored:
            self.space.mark_full()
        return value

    def store_guest(self, nbytes: int, write: Callable[[], T]) -> T | None:
        """:meth:`store` for guest data: written only into room under the low watermark, making room by evicting
        other guest data only; None when not stored, which is no error (its owner keeps it)."""
        if time.monotonic() < self._guests_full_until:
            return None
        stored, value = _write_making_room_once(lambda: nbytes <= self.space.guest_room(),
                                                lambda: self.eviction.make_guest_room(nbytes), write)
        if not stored:
            self._guests_full_until = time.monotonic() + FULL_BACKOFF
        return value

    def note_stored(self, nbytes: int) -> None:
        """``nbytes`` more are on the disk (from the event loop)."""
        self.eviction.note_stored(nbytes)

    def _store_for_scan(self, dataset: str, since: float, nbytes: int, write: Callable[[], T], ahead: bool) -> T | None:
        limit, floor = self.eviction.high - nbytes, self.eviction.floor_for(nbytes)
        passed = self.next_use.passed if ahead and self.next_use else None

        def make_room() -> bool:
            # What fits without evicting is written even while the scan's writes back off (the part of a pack
            # that fits the last room: Admission.room); evicting for it waits for the backoff to end.
            if self.scan_refusing(dataset):
                return False
            self.eviction.make_room_for_scan(dataset, since, limit, floor, passed)
            return True

        stored, value = _write_making_room_once(lambda: self.eviction.under(limit, floor), make_room, write)
        if stored:
            return value
        if not self.scan_refusing(dataset):
            self._scan_full_until[dataset] = time.monotonic() + FULL_BACKOFF
        if ahead:
            self._ahead_full_until[dataset] = time.monotonic() + FULL_BACKOFF
        return None


def _write_making_room_once(fits: Callable[[], bool], make_room: Callable[[], object], write: Callable[[], T]
                            ) -> tuple[bool, T | None]:
    """The rule every writer of cached bytes follows: ``write()`` if the bytes ``fits()``; if not (or the write
    found the disk full after all), ``make_room()`` once and try again; a ``make_room()`` that answers False
    made none, and the write is not tried again. (Whether it was stored, what ``write()`` returned.)"""
    for attempt in (0, 1):
        if fits():
            try:
                return True, write()
            except CacheFullError:
                pass
        if attempt == 0 and make_room() is False:
            break
    return False, None

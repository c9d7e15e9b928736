"""Directory read-ahead's state: after a miss on a small file, which files of its directory come next.

A tree of small files is mostly read in listing order, so after a miss the next ``count`` files of the same
directory are worth fetching (:func:`~cachefs.prefetch.planners.directory_ahead`), from where the previous
read-ahead of that directory got to rather than from the start. This keeps, per directory, the sorted listing of
the reader's manifest version (for the last :data:`MAX_LISTINGS` directories) and how far read-ahead reached.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

from cachefs.base.types import Entry
from cachefs.manifest.dataset import Dataset
from cachefs.prefetch.planners import directory_ahead

__all__ = ["MAX_LISTINGS", "DirectoryAhead"]

#: Directories whose sorted listings are kept.
MAX_LISTINGS = 64
#: Directories whose read-ahead positions are kept (forgetting one only restarts it after the next miss).
_MAX_POSITIONS = 4096


class DirectoryAhead:
    """The files to read ahead after misses, ``count`` at a time. Call from the event loop."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._listings: OrderedDict[tuple[str, int, str], tuple[list[str], list[Entry]]] = OrderedDict()
        self._reached: dict[tuple[str, str], int] = {}  # (dataset, dir) → listing position read-ahead reached

    def after_miss(self, ds: Dataset, entry: Entry) -> list[Entry]:
        """The entries of ``entry``'s directory to fetch after a miss on it (directories among them too: the
        caller keeps what it can fetch)."""
        if self.count <= 0:
            return []
        parent, _, name = entry.path.rpartition("/")
        names, entries = self._listing(ds, parent)
        key = (ds.ref.id, parent)
        plan = directory_ahead(bisect.bisect_left(names, name), self._reached.get(key, 0), self.count)
        if len(self._reached) > _MAX_POSITIONS:
            self._reached.clear()
        self._reached[key] = plan.stop
        return entries[plan.start:plan.stop]

    def _listing(self, ds: Dataset, parent: str) -> tuple[list[str], list[Entry]]:
        key = (ds.ref.id, ds.version, parent)
        got = self._listings.get(key)
        if got is None:
            entries = sorted(ds.listdir(parent), key=lambda e: e.path.rpartition("/")[2])
            got = self._listings[key] = ([e.path.rpartition("/")[2] for e in entries], entries)
            while len(self._listings) > MAX_LISTINGS:
                self._listings.popitem(last=False)
        else:
            self._listings.move_to_end(key)
        return got

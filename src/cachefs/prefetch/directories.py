"""Directory read-ahead's state: after a miss on a small file, which files of its directory come next.

A tree of small files is mostly read in listing order, so after a miss the next ``count`` files of the same
directory are worth fetching, from where the previous read-ahead of that directory got to rather than from the
start. The files are read from the manifest (in name order, as the listing) a page of ``count`` at a time, so a
directory of millions costs no more than one of ten; kept is only, per directory, the name read-ahead reached.
"""

from __future__ import annotations

import bisect

from cachefs.base.types import Entry
from cachefs.manifest.dataset import Dataset
from cachefs.prefetch.planners import directory_ahead

__all__ = ["DirectoryAhead"]

#: Directories whose read-ahead positions are kept (forgetting one only restarts it after the next miss).
_MAX_POSITIONS = 4096


class DirectoryAhead:
    """The files to read ahead after misses, ``count`` at a time. Call from the event loop."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._reached: dict[tuple[str, int, str], str] = {}  # (dataset, version, dir) → the last name read ahead

    def after_miss(self, ds: Dataset, entry: Entry) -> list[Entry]:
        """The entries of ``entry``'s directory to fetch after a miss on it: the ``count`` that follow it, less
        those an earlier read-ahead of the directory took (directories among them too: the caller keeps what it
        can fetch)."""
        if self.count <= 0:
            return []
        parent, _, name = entry.path.rpartition("/")
        key = (ds.ref.id, ds.version, parent)
        following = ds.listdir_page(parent, name, self.count)
        if not following:
            return []
        # Positions counted from the miss (0): following[i] is at i + 1; reached is one past the last read ahead.
        reached = self._reached.get(key)
        at = 0
        if reached is not None and name < reached <= following[-1].name:
            at = 1 + bisect.bisect_right([e.name for e in following], reached)
        plan = directory_ahead(0, at, self.count)
        if len(self._reached) >= _MAX_POSITIONS:
            self._reached.clear()
        self._reached[key] = following[-1].name
        return following[plan.start - 1:plan.stop - 1]

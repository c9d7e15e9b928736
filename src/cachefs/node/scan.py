"""Telling an epoch scan from other reading, per dataset, from the files readers open.

Training reads every file of a dataset once per epoch, in a new random order each time. Under LRU a dataset that
does not fit then hits c + (1 - c)·ln(1 - c) for a cache holding a fraction c of it (15 % at c = 0.5), because
what was kept is evicted just before it is read again. Keeping a fixed part of it instead, and letting the rest
pass through uncached, hits c (CoorDL's policy). So a dataset read as a scan gets that policy: admission admits
its bytes only into room it does not have to take from anything used since the scan began, and never evicts the
scan's own bytes to admit more of it (:meth:`cachefs.node.admission.Admission.store`).

What counts as a scan: within a pass (the files opened since the last epoch boundary), few opens are of a file
already opened in that pass. A pass ends when most of the last :data:`WINDOW` opens were repeats (the next epoch
has begun); a hot set read over and over keeps ending its passes with few distinct files, and is not a scan. Once
a dataset was read so, only a pass of :data:`LONG_WINDOW` new files makes it a scan (a one-off sweep through
cold files between reads of a hot set is not an epoch).
Each process classifies what its own readers open (a DataLoader worker reads a uniform subset of the epoch, which
is a scan too) and publishes it in the index (:class:`cachefs.index.hints.HintStore`), so every process of the
node applies the same policy; a scan nobody renews expires after :data:`SCAN_TTL` seconds. A dataset larger than
the cache is presumed scanned from its first read until its reads show otherwise (:meth:`ScanDetector.presume`).

Hits and misses are counted per pass too, so ``cachefs status`` can show the hit ratio of the current and the
last epoch beside the policy in force.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from cachefs.index.hints import ScanRecord

__all__ = ["LONG_WINDOW", "MAX_REPEATS", "SCAN_TTL", "WINDOW", "ScanDetector"]

#: Opens a pass needs before it can count as a scan, and the window that tells a new epoch has begun.
WINDOW = 256
#: Opens a pass needs to count as a scan in a dataset that was read as a working set before.
LONG_WINDOW = 8 * WINDOW
#: A pass with more than this fraction of repeated opens is not a scan.
MAX_REPEATS = 0.1
#: Seconds a published scan lasts unless a process renews it.
SCAN_TTL = 120.0
#: Distinct files remembered per pass and dataset (a pass of more is still classified: by its sample).
_MAX_SEEN = 1 << 22


@dataclass
class _Pass:
    seen: set[int] = field(default_factory=set)
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (path hash, was a repeat)
    opens: int = 0
    repeats: int = 0
    hit: int = 0
    miss: int = 0


@dataclass
class _Dataset:
    current: _Pass = field(default_factory=_Pass)
    last: tuple[int, int] | None = None  # (hit, miss) bytes of the last whole pass
    passes: int = 1
    scanning_since: float | None = None
    touched: float = 0.0
    needed: int = WINDOW  # opens of few repeats that make a pass a scan
    presumed: bool = False  # a scan from the first open on (ScanDetector.presume)


class ScanDetector:
    """Per-dataset scan classification of this process's opens. Not thread-safe: its caller holds a lock."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self._datasets: dict[str, _Dataset] = {}

    def note(self, ds_id: str, path: str | None, hit: int, miss: int) -> None:
        """A read of ``hit`` and ``miss`` bytes of dataset ``ds_id``; ``path``: the file was opened (its first read)."""
        d = self._datasets.get(ds_id)
        if d is None:
            d = self._datasets[ds_id] = _Dataset()
        p = d.current
        p.hit += hit
        p.miss += miss
        if path is None:
            return
        d.touched = self.clock()
        if d.presumed:
            d.presumed = False
            d.scanning_since = d.touched
        h = hash(path)
        repeat = h in p.seen
        if not repeat and len(p.seen) < _MAX_SEEN:
            p.seen.add(h)
        p.opens += 1
        p.repeats += repeat
        p.recent.append((h, repeat))
        if len(p.recent) == WINDOW and len(p.seen) > WINDOW and sum(r for _, r in p.recent) > WINDOW // 2:
            self._next_pass(d)
        elif p.opens >= WINDOW:
            is_scan = p.repeats <= MAX_REPEATS * p.opens
            if is_scan and d.scanning_since is None and p.opens >= d.needed:
                d.scanning_since = self.clock()
            elif not is_scan and p.repeats > 3 * MAX_REPEATS * p.opens:
                # Re-reading within the pass: a working set, not a scan. A dataset read so once needs a longer
                # pass of new files to count as scanned again (a one-off sweep through it is not an epoch).
                d.scanning_since = None
                d.needed = LONG_WINDOW

    def _next_pass(self, d: _Dataset) -> None:
        """Most recent opens repeat this pass: the next epoch has begun. Its opens so far start the new pass."""
        old = d.current
        d.last = (old.hit, old.miss)
        d.passes += 1
        new = _Pass()
        for h, _ in old.recent:
            if h not in new.seen:
                new.seen.add(h)
                new.recent.append((h, False))
                new.opens += 1
        d.current = new

    def presume(self, ds_id: str) -> None:
        """Treat a dataset this process has not seen read yet as scanned from its first read until its reads say
        otherwise (one larger than the cache: before the first window is classified, read-ahead and LRU would
        churn it). A prefetch job, which reads nothing, leaves it as it is."""
        if ds_id not in self._datasets:
            self._datasets[ds_id] = _Dataset(presumed=True, touched=self.clock())

    def scanning(self, ds_id: str) -> bool:
        d = self._datasets.get(ds_id)
        return d is not None and d.scanning_since is not None

    def records(self, now: float | None = None) -> dict[str, ScanRecord]:
        """What to publish: the datasets this process sees scanned (opened within :data:`SCAN_TTL`)."""
        now = self.clock() if now is None else now
        out = {}
        for ds_id, d in list(self._datasets.items()):
            if now - d.touched > SCAN_TTL:
                del self._datasets[ds_id]  # not read for a while: forget it
                continue
            if d.scanning_since is not None:
                out[ds_id] = ScanRecord(since=d.scanning_since, until=now + SCAN_TTL, passes=d.passes,
                                        current=(d.current.hit, d.current.miss), last=d.last)
        return out

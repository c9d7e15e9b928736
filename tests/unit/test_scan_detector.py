"""Telling an epoch scan from other reading (cachefs.node.scan) on traces: shuffled epochs are a scan, skewed
and hot-set reading are not, and a pass's hit and miss bytes become the last epoch's when the next one begins."""

from __future__ import annotations

import random

from bench.eviction_bench import traces
from cachefs.node.scan import SCAN_TTL, WINDOW, ScanDetector


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _epochs(n: int, epochs: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        out += order
    return out


def _feed(det: ScanDetector, trace: list[int], clock: Clock, ds: str = "ds") -> list[bool]:
    seen = []
    for i in trace:
        clock.now += 0.001
        det.note(ds, f"f{i}", 0, 10)
        seen.append(det.scanning(ds))
    return seen


def test_shuffled_epochs_are_a_scan_from_the_first_window_and_count_their_passes():
    clock = Clock()
    det = ScanDetector(clock)
    seen = _feed(det, _epochs(2000, 3), clock)
    assert not any(seen[:WINDOW - 1]) and all(seen[WINDOW:]), seen.index(True)
    rec = det.records()["ds"]
    assert rec.passes == 3  # two epoch boundaries seen
    assert rec.last is not None and rec.last[1] > 0.8 * 2000 * 10  # the last whole epoch's misses
    assert rec.until == clock.now + SCAN_TTL


def test_a_worker_reading_every_other_sample_of_each_epoch_is_a_scan_too():
    """A DataLoader worker (or one rank of DistributedSampler) reads a uniform share of each epoch."""
    clock = Clock()
    det = ScanDetector(clock)
    _feed(det, [i for i in _epochs(4000, 3) if i % 2 == 0], clock)
    assert det.scanning("ds") and det.records()["ds"].passes == 3


def test_skewed_and_hot_set_reading_is_not_a_scan():
    clock = Clock()
    all_traces = traces()
    for name in ("zipf", "hot+scan"):
        det = ScanDetector(clock)
        seen = _feed(det, all_traces[name][0][:20_000], clock, name)
        assert sum(seen) < 0.05 * len(seen), (name, sum(seen))
        assert not det.scanning(name) and name not in det.records()


def test_a_scan_that_stops_is_forgotten_after_its_ttl():
    clock = Clock()
    det = ScanDetector(clock)
    _feed(det, _epochs(1000, 1), clock)
    assert "ds" in det.records()
    clock.now += SCAN_TTL + 1
    assert det.records() == {} and not det.scanning("ds")


def test_datasets_are_classified_apart():
    clock = Clock()
    det = ScanDetector(clock)
    hot = random.Random(5)
    for i in _epochs(1500, 2):
        clock.now += 0.001
        det.note("scanned", f"f{i}", 0, 1)
        det.note("hot", f"h{hot.randrange(50)}", 1, 0)
    assert det.scanning("scanned") and not det.scanning("hot")


def test_a_presumed_scan_starts_at_the_first_open_and_ends_when_reads_repeat():
    clock = Clock()
    det = ScanDetector(clock)
    det.presume("big")
    clock.now += 5
    assert not det.scanning("big") and det.records() == {}  # (a prefetch job reads nothing: no scan)
    det.note("big", "f0", 0, 1)
    assert det.scanning("big") and det.records()["big"].since == clock.now
    hot = random.Random(2)
    for _ in range(WINDOW):
        det.note("big", f"f{hot.randrange(40)}", 1, 0)
    assert not det.scanning("big")

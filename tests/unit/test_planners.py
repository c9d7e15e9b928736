"""The read-ahead planners are pure functions: table-driven tests."""

from __future__ import annotations

import pytest

from cachefs.prefetch.planners import blocks_ahead, directory_ahead, grow_window, mirror_windows, sweep, window_of


@pytest.mark.parametrize("window, sequential, max_window, want", [
    (0, True, 16, 1),      # a first sequential read opens the window
    (1, True, 16, 2),
    (8, True, 16, 16),
    (16, True, 16, 16),    # capped
    (8, False, 16, 0),     # a jump closes it
    (0, False, 16, 0),
    (0, True, 0, 0),       # read-ahead off
])
def test_grow_window(window, sequential, max_window, want):
    assert grow_window(window, sequential, max_window) == want


@pytest.mark.parametrize("next_offset, window, nblocks, want", [
    (0, 2, 10, range(0, 2)),
    (100, 2, 10, range(1, 3)),     # a block only partly read is not ahead of the reader
    (1024, 4, 10, range(1, 5)),
    (1024 * 9, 4, 10, range(9, 10)),  # clipped at the end of the object
    (1024 * 10, 4, 10, range(10, 10)),
    (0, 0, 10, range(0, 0)),
])
def test_blocks_ahead(next_offset, window, nblocks, want):
    assert blocks_ahead(next_offset, window, 1024, nblocks) == want


@pytest.mark.parametrize("pos, reached, count, want", [
    (0, 0, 4, range(1, 5)),        # first miss in a directory
    (2, 5, 4, range(5, 7)),        # carries on where the last read-ahead got to
    (2, 20, 4, range(3, 7)),       # that mark is past this plan (the reader jumped back): start afresh
    (10, 5, 4, range(11, 15)),     # the mark is behind the reader: start afresh
    (3, 4, 0, range(4, 4)),        # directory read-ahead off
])
def test_directory_ahead(pos, reached, count, want):
    assert directory_ahead(pos, reached, count) == want


def test_sweep_reads_a_pack_ahead_once_enough_reads_fall_in_the_window_then_once_per_window():
    state, ahead = None, []
    for t in (0.0, 1.0, 2.0, 2.5, 3.0):
        state, now = sweep(state, t, reads=3, window=5.0)
        ahead.append(now)
    assert ahead == [False, False, True, False, False]  # the third read in 5 s; not again within 5 s
    state, now = sweep(state, 7.5, reads=3, window=5.0)  # a new window: counting starts over
    assert not now
    state, now = sweep(state, 8.0, reads=3, window=5.0)
    state, now = sweep(state, 8.5, reads=3, window=5.0)
    assert now  # three reads in the new window, and 5 s since the last read-ahead
    _, now = sweep(None, 0.0, reads=1, window=5.0)
    assert now


def test_window_of():
    bounds = [0, 100, 250, 400]
    assert [window_of(bounds, o) for o in (0, 99, 100, 249, 250, 399)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("pack, window, windows, here, want", [
    (0, 1, {0: 3, 1: 2}, {0: False, 1: False}, [(0, 1), (0, 0), (0, 2), (1, 0), (1, 1)]),
    (0, 0, {0: 2, 1: 2}, {0: False, 1: True}, [(0, 0), (0, 1)]),          # the next pack is here already
    (3, 0, {3: 2}, {3: False}, [(3, 0), (3, 1)]),                         # the last pack: no next one
    (0, 0, {0: 2, 1: 1}, {0: True, 1: False}, [(0, 0), (1, 0)]),          # its own pack here: its window only
])
def test_mirror_windows(pack, window, windows, here, want):
    assert mirror_windows(pack, window, windows, here) == want

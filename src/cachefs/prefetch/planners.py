"""Read-ahead plans as pure functions: what to fetch before a reader asks, from what it did so far.

* :func:`grow_window` / :func:`blocks_ahead` — a sequential reader of a large file: a window of blocks ahead of
  it that doubles with every read that continues where the last one ended (1, 2, 4, … up to a maximum), and
  closes at the first jump.
* :func:`directory_ahead` — a reader of small files, after a miss: the next files of the same directory in
  listing order (a tree is mostly read in order), continuing where the previous read-ahead of that directory
  stopped rather than starting over.
* :func:`sweep` — many reads of one pack within a few seconds: the pack is being swept (an epoch, a directory
  in order) and is worth reading into the page cache whole.
* :func:`mirror_windows` — a miss on a file of a packed mirror: its window first, then the other windows of its
  pack and of the next pack (readers move through a mirror in pack order).

They are pure: the strategies keep the state and do the fetching.
"""

from __future__ import annotations

import bisect

__all__ = ["blocks_ahead", "directory_ahead", "grow_window", "mirror_windows", "sweep", "window_of"]


def grow_window(window: int, sequential: bool, max_window: int) -> int:
    """The read-ahead window (in blocks) after a read: doubled (from 1) if it continued the last one, else 0."""
    return min(max(1, window * 2), max_window) if sequential else 0


def blocks_ahead(next_offset: int, window: int, block_size: int, nblocks: int) -> range:
    """The blocks a window of ``window`` blocks covers past ``next_offset`` (a block it only partly covers
    is included from its start)."""
    first = -(-next_offset // block_size)
    return range(first, min(nblocks, first + window))


def directory_ahead(pos: int, reached: int, count: int) -> range:
    """Positions in a directory's listing to read ahead after a miss at ``pos``: the ``count`` that follow it,
    from where an earlier read-ahead of this directory got to (``reached``) if that is within them."""
    start = reached if pos + 1 <= reached <= pos + 1 + count else pos + 1
    return range(start, pos + 1 + count)


def sweep(state: tuple[float, int, float] | None, now: float, reads: int, window: float
          ) -> tuple[tuple[float, int, float], bool]:
    """One more read of a pack. ``state`` is (start of the current window, reads in it, when the pack was last
    read ahead). Returns the new state and whether to read the pack ahead now: once ``reads`` reads fall in
    ``window`` seconds, then at most once per ``window``."""
    start, n, ahead_at = state if state is not None else (now, 0, -window)
    if now - start > window:
        start, n = now, 0
    n += 1
    if n < reads or now - ahead_at < window:
        return (start, n, ahead_at), False
    return (start, n, now), True


def window_of(bounds: list[int], offset: int) -> int:
    """The window (index into ``bounds``, see MirrorIndex.bounds) that holds ``offset``."""
    return bisect.bisect_right(bounds, offset) - 1


def mirror_windows(pack: int, window: int, windows: dict[int, int], here: dict[int, bool]) -> list[tuple[int, int]]:
    """The (pack, window) fetches after a miss in window ``window`` of ``pack``: that window first, then the
    rest of the pack, then the next pack's windows (``windows[p]`` each; a pack missing from ``windows`` does not
    exist), skipping packs that are here already (``here[p]``)."""
    plan = [(pack, window)]
    for p in (pack, pack + 1):
        if p not in windows or here.get(p, False):
            continue
        plan += [(p, w) for w in range(windows[p]) if (p, w) != (pack, window)]
    return plan

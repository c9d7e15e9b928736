"""Declared read orders: what a job says it will read next, so the node fetches exactly that ahead of it.

A job publishes the order of an epoch (``cachefs.publish_order``, ``cachefs order``,
``cachefs.torch.PublishingSampler``); it lands in the cache directory as one file per publisher
(:mod:`cachefs.index.orders`), so every process of the node that reads the dataset (the FUSE daemon,
``cachefs::`` readers, prefetch) sees it, and two jobs reading one dataset each have their own order (neither
replaces the other's).

:class:`OrderBook` is a process's view: it re-reads the directory at most once a second, and for each file a
reader opens tells what comes next in the orders that hold it: the reader's position in an order is the furthest
file of it opened so far (:meth:`_Order.follows` keeps another job's reader from moving it), and each file is
handed out once per order (a new order, the next epoch's, starts afresh).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cachefs.base.errors import ConfigError
from cachefs.index.orders import list_orders, read_order

__all__ = ["FOLLOW_SLACK", "OrderBook", "published_here", "relative_paths"]

#: How far from a reader's position (in files) an open still counts as that reader moving on (a sixteenth of
#: the order if less, at least 8).
FOLLOW_SLACK = 256


@dataclass
class _Order:
    publisher: str
    epoch: int | None
    stamp: tuple[float, int]  # (mtime, size) of its file when read
    paths: list[str]
    position: dict[str, int] = field(default_factory=dict)
    reached: int = -1  # the furthest position a reader opened
    handed: int = -1  # positions up to here were handed out for fetching
    ahead: deque = field(default_factory=deque)  # (position, bytes) handed out past the reader
    ahead_bytes: int = 0
    last_stray: int = -1  # the last open that did not follow the order
    opened_at: float = 0.0  # when its reader last moved on
    per_file: float = 0.0  # seconds its reader takes per file (a moving average)

    def __post_init__(self) -> None:
        if not self.position:
            self.position = {p: i for i, p in enumerate(self.paths)}

    def follows(self, pos: int) -> bool:
        """Whether an open at ``pos`` is this order's reader moving on: near where it is (readers in parallel,
        DataLoader workers, open a little out of order), or a second open just after an earlier stray one (the
        reader started or resumed elsewhere in it). Another job's reader opening the same files in its own order
        lands at random positions of this one, and moves nothing."""
        slack = max(8, min(FOLLOW_SLACK, len(self.paths) // 16))
        near = self.reached - slack <= pos <= self.reached + slack + 1
        if near or (self.last_stray >= 0 and 0 < pos - self.last_stray <= slack):
            self.last_stray = -1
            return True
        self.last_stray = pos
        return False


_books: weakref.WeakSet[OrderBook] = weakref.WeakSet()


def published_here(cache_dir: str, ds_id: str) -> None:
    """An order of ``ds_id`` was just written into ``cache_dir`` by this process: its books read it at their next
    look, not up to a second later (a reader in this process may start on it at once)."""
    here = os.path.realpath(cache_dir)
    for book in list(_books):
        if os.path.realpath(book.cache_dir) == here:
            book.reread(ds_id)


class OrderBook:
    """This process's view of the node's published orders. Thread-safe."""

    def __init__(self, cache_dir: str, *, clock=time.time) -> None:
        self.cache_dir = cache_dir
        self.clock = clock
        self._lock = threading.Lock()
        self._orders: dict[str, dict[str, _Order]] = {}  # dataset id → publisher → order
        self._read_at: dict[str, float] = {}
        _books.add(self)

    def _refresh(self, ds_id: str) -> dict[str, _Order]:
        now = time.monotonic()
        if now - self._read_at.get(ds_id, -2.0) < 1.0:
            return self._orders.get(ds_id, {})
        self._read_at[ds_id] = now
        old = self._orders.get(ds_id, {})
        new: dict[str, _Order] = {}
        for f in list_orders(self.cache_dir, ds_id, self.clock()):
            known = old.get(f.publisher)
            if known is not None and known.stamp == f.stamp:
                new[f.publisher] = known
                continue
            got = read_order(f.path)
            if got is not None:
                new[f.publisher] = _Order(f.publisher, got[0], f.stamp, got[1])
        if new:
            self._orders[ds_id] = new
        else:
            self._orders.pop(ds_id, None)
        return new

    def reread(self, ds_id: str) -> None:
        """Read ``ds_id``'s orders again at the next look (this process has just published one)."""
        with self._lock:
            self._read_at.pop(ds_id, None)

    def _still_ahead(self, ds_id: str, order: _Order, pos: int) -> bool:
        with self._lock:
            return pos > order.reached and self._orders.get(ds_id, {}).get(order.publisher) is order

    def ahead(self) -> tuple[int, int, float]:
        """Over every order this process follows: files and bytes handed out past their readers, and how many
        seconds of reading that is (the furthest ahead of them)."""
        with self._lock:
            orders = [o for by_publisher in self._orders.values() for o in by_publisher.values()]
            return (sum(len(o.ahead) for o in orders), sum(o.ahead_bytes for o in orders),
                    max((len(o.ahead) * o.per_file for o in orders), default=0.0))

    def passed(self, ds_id: str, path: str) -> bool:
        """Whether every order of ``ds_id`` that holds ``path`` has had its reader go past it (it is not read again
        in this epoch); False for a file no order holds, or with no order. An order its reader has finished says
        nothing: the next epoch's, about to be read (within a second), reads every file again."""
        with self._lock:
            holding = [o for o in self._orders.get(ds_id, {}).values() if path in o.position]
            return bool(holding) and all(o.position[path] < o.reached < len(o.paths) - 1 for o in holding)

    def orders(self, ds_id: str) -> list[dict]:
        """What ``cachefs status`` shows of a dataset's orders."""
        with self._lock:
            return [{"publisher": o.publisher, "epoch": o.epoch, "files": len(o.paths), "reached": o.reached + 1,
                     "ahead": len(o.ahead), "ahead_bytes": o.ahead_bytes} for o in self._refresh(ds_id).values()]

    def opened(self, ds_id: str, path: str, budget: int, size_of) -> list[tuple[str, Callable[[], bool]]]:
        """A reader opened ``path`` of dataset ``ds_id``: the paths to fetch ahead of it now, in order, at most
        ``budget`` bytes of them past the reader (``size_of(path)``: a file's size, or None to skip it), each
        with a check of whether it is still ahead of its reader (when its fetch starts: one the reader passed
        meanwhile is not fetched again)."""
        with self._lock:
            orders = self._refresh(ds_id)
            out: list[tuple[str, Callable[[], bool]]] = []
            for o in orders.values():
                pos = o.position.get(path)
                if pos is None or not o.follows(pos):
                    continue
                now = time.monotonic()
                if pos > o.reached >= 0 and o.opened_at:
                    step = (now - o.opened_at) / (pos - o.reached)
                    o.per_file = step if not o.per_file else 0.9 * o.per_file + 0.1 * step
                if pos > o.reached:
                    o.opened_at = now
                o.reached = max(o.reached, pos)
                while o.ahead and o.ahead[0][0] <= o.reached:
                    o.ahead_bytes -= o.ahead.popleft()[1]
                i = max(o.handed, o.reached) + 1
                while i < len(o.paths) and o.ahead_bytes < budget:
                    size = size_of(o.paths[i])
                    if size is not None:
                        o.ahead.append((i, size))
                        o.ahead_bytes += size
                        out.append((o.paths[i], functools.partial(self._still_ahead, ds_id, o, i)))
                    i += 1
                o.handed = max(o.handed, i - 1)
            return out


def relative_paths(paths: Iterable[str], roots: Iterable[str]) -> list[str]:
    """``paths`` relative to the dataset: each may be relative already, or start with one of ``roots`` (the
    dataset's URL, a mount point); ConfigError for one that names something else."""
    prefixes = [r.rstrip("/") + "/" for r in roots if r]
    out = []
    for p in paths:
        if not isinstance(p, str):
            raise ConfigError(f"order path {p!r}: not a string")
        for pre in prefixes:
            if p.startswith(pre):
                p = p[len(pre):]
                break
        else:
            if "://" in p or p.startswith("/"):
                raise ConfigError(f"order path {p!r} is not under the dataset ({', '.join(prefixes)})")
        out.append(p.lstrip("/"))
    return out

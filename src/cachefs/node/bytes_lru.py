"""Bytes kept in memory, least recently used out past a byte limit: blocks a full disk could not take, and what
a cache group's peers sent that this node does not store (its readers and read-ahead still need them)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["BytesLRU"]


class BytesLRU:
    """Thread-safe; ``get`` of a key that is not here takes no lock while the cache is empty (the usual case on
    the read paths that consult it)."""

    def __init__(self, limit: int, *, promote: bool = True) -> None:
        """``promote``: a ``get`` makes the item the most recently used (False: the oldest put goes first, for
        items that are read in the order they were put)."""
        self.limit, self.used, self.promote = limit, 0, promote
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __bool__(self) -> bool:
        return bool(self._items)

    def get(self, key: Hashable) -> bytes | None:
        if not self._items:
            return None
        with self._lock:
            data = self._items.get(key)
            if data is not None and self.promote:
                self._items.move_to_end(key)
            return data

    def put(self, key: Hashable, data: bytes) -> None:
        """Keep ``data`` (not if it alone is over the limit), dropping the least recently used past the limit."""
        with self._lock:
            if key in self._items or len(data) > self.limit:
                return
            self._items[key] = data
            self.used += len(data)
            while self.used > self.limit:
                _, old = self._items.popitem(last=False)
                self.used -= len(old)

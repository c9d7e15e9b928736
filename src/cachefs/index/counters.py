"""Node-wide counters kept in the index, so that every process of one cache directory adds to the same figures and
``cachefs status`` reports that directory's, not the whole host's: ``tier:<name>``, bytes served to readers by where
they came from (``local`` for hits, then each tier: ``peer``, ``mirror``, ``origin``), and ``corrupt:<kind>``, cached
blocks and small files that failed their checksum on the disk.

Layout (docs/FORMAT.md): meta key ``b"count:" + name``; value = the count (u64).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from cachefs.index.index import Index

__all__ = ["NodeCounters"]

_U64 = struct.Struct("<Q")
_PREFIX = b"count:"


class NodeCounters:
    def __init__(self, index: Index) -> None:
        self.index = index
        self._meta = index.dbs["meta"]

    def add(self, deltas: Mapping[str, int]) -> None:
        """Add to counters (deltas since the last call) in one transaction."""
        todo = {k: v for k, v in deltas.items() if v}
        if not todo:
            return

        def body(txn) -> None:
            for name, n in todo.items():
                key = _PREFIX + name.encode()
                raw = txn.get(key, db=self._meta)
                txn.put(key, _U64.pack((_U64.unpack(raw)[0] if raw else 0) + n), db=self._meta)

        self.index.write_txn(body)

    def read(self, prefix: str) -> dict[str, int]:
        """The counters named ``prefix`` + something, by that something (``read("tier:")``: bytes per tier)."""
        start = _PREFIX + prefix.encode()
        out = {}
        with self.index.env.begin() as txn:
            cur = txn.cursor(db=self._meta)
            if cur.set_range(start):
                for key, raw in cur:
                    if not bytes(key).startswith(start):
                        break
                    out[bytes(key)[len(start):].decode()] = _U64.unpack(raw)[0]
        return out

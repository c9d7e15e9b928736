"""Eviction hints, kept in the index so that every process on the node evicts alike (:mod:`cachefs.node.eviction_policy`).

* **Leases** on "keep what was used since T": a prefetch job takes one while it runs (renewing it) and drops it when
  it ends; one that dies leaves a lease that expires on its own, so a killed job never pins the cache for long.
* **Staged keys**: bytes written on this node and not yet uploaded, which eviction never takes.

Layouts (docs/FORMAT.md): ``hints``: key = ``b"keep:" + lease name``; value = since, expires (two float64).
``staged``: key = object key; value = bytes staged (u64).
"""

from __future__ import annotations

import struct
import time

from cachefs.index.index import Index

__all__ = ["LEASE", "HintStore"]

#: hints: a keep-newer-than lease: since when, until when (epoch seconds).
LEASE = struct.Struct("<dd")
_STAGED = struct.Struct("<Q")
_KEEP = b"keep:"


class HintStore:
    """The hints of one cache directory's index."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._hints, self._staged = index.dbs["hints"], index.dbs["staged"]

    # -- leases ---------------------------------------------------------------------------------------------
    def keep_newer_than(self, name: str, since: float, ttl: float) -> None:
        """Take (or renew) lease ``name``: what was used at or after ``since`` stays, for ``ttl`` seconds."""
        value = LEASE.pack(since, time.time() + ttl)
        self.index.write_txn(lambda txn: txn.put(_KEEP + name.encode(), value, db=self._hints))

    def release(self, name: str) -> None:
        self.index.write_txn(lambda txn: txn.delete(_KEEP + name.encode(), db=self._hints))

    def kept_newer_than(self, now: float | None = None) -> float | None:
        """The earliest ``since`` of the leases in force, or None."""
        now = time.time() if now is None else now
        earliest = None
        with self.index.env.begin() as txn:
            cur = txn.cursor(db=self._hints)
            if cur.set_range(_KEEP):
                for key, raw in cur:
                    if not bytes(key).startswith(_KEEP):
                        break
                    since, expires = LEASE.unpack(raw)
                    if expires > now and (earliest is None or since < earliest):
                        earliest = since
        return earliest

    # -- staged bytes ---------------------------------------------------------------------------------------
    def stage(self, key: bytes, nbytes: int) -> None:
        self.index.write_txn(lambda txn: txn.put(key, _STAGED.pack(nbytes), db=self._staged))

    def unstage(self, key: bytes) -> None:
        self.index.write_txn(lambda txn: txn.delete(key, db=self._staged))

    def staged(self) -> frozenset[bytes]:
        with self.index.env.begin() as txn:
            return frozenset(bytes(k) for k, _v in txn.cursor(db=self._staged))

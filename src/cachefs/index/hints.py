"""Eviction hints, kept in the index so that every process on the node evicts alike (:mod:`cachefs.node.eviction_policy`).

* **Leases** on "keep what was used since T": a prefetch job takes one while it runs (renewing it) and drops it when
  it ends; one that dies leaves a lease that expires on its own, so a killed job never pins the cache for long.
* **Staged keys**: bytes written on this node and not yet uploaded, which eviction never takes.
* **Pins**: datasets eviction passes over (an explicit purge still takes them), each set by a source (``cli`` for
  ``cachefs pin``, ``cachedatasets`` for the agent following CacheDatasets' ``spec.pin``) that replaces its own.
* **Scans**: datasets some process sees read as an epoch scan (:mod:`cachefs.node.scan`), since when, until when
  the claim lasts, and the hit and miss bytes of the current and the last pass (what ``cachefs status`` shows).

Layouts (docs/FORMAT.md): ``hints``: key = ``b"keep:" + lease name``; value = since, expires (two float64);
key = ``b"scan:" + dataset id``; value = JSON (:class:`ScanRecord`); key = ``b"pin:" + dataset id + b"\0" +
source``; value = since (float64). ``staged``: key = object key; value = bytes
staged (u64).
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass

from cachefs.index.index import Index

__all__ = ["LEASE", "HintStore", "ScanRecord"]

#: hints: a keep-newer-than lease: since when, until when (epoch seconds).
LEASE = struct.Struct("<dd")
_STAGED = struct.Struct("<Q")
_KEEP = b"keep:"
_SCAN = b"scan:"
_PIN = b"pin:"
_SINCE = struct.Struct("<d")


@dataclass(frozen=True)
class ScanRecord:
    """A dataset read as an epoch scan: since when, until when the claim lasts (unless renewed), how many passes
    (epochs) its publisher saw, and the (hit, miss) bytes of the current and the last whole pass."""

    since: float
    until: float
    passes: int = 1
    current: tuple[int, int] = (0, 0)
    last: tuple[int, int] | None = None

    def to_json(self) -> bytes:
        return json.dumps({"since": self.since, "until": self.until, "passes": self.passes,
                           "current": list(self.current), "last": list(self.last) if self.last else None}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ScanRecord:
        d = json.loads(raw)
        last = d.get("last")
        return cls(float(d["since"]), float(d["until"]), int(d.get("passes", 1)), tuple(d.get("current", (0, 0))),
                   tuple(last) if last else None)


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
        for _, raw in self._prefixed(_KEEP):
            since, expires = LEASE.unpack(raw)
            if expires > now and (earliest is None or since < earliest):
                earliest = since
        return earliest

    def _prefixed(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The hints whose keys start with ``prefix``: (the rest of the key, value)."""
        with self.index.env.begin() as txn:
            cur = txn.cursor(db=self._hints)
            if not cur.set_range(prefix):
                return []
            out = []
            for key, raw in cur:
                if not bytes(key).startswith(prefix):
                    break
                out.append((bytes(key)[len(prefix):], bytes(raw)))
            return out

    # -- scans ----------------------------------------------------------------------------------------------
    def note_scans(self, records: dict[str, ScanRecord]) -> None:
        """Publish (or renew) this process's scans; an earlier ``since`` another process published is kept."""
        if not records:
            return

        def put(txn) -> None:
            for ds_id, rec in records.items():
                key = _SCAN + ds_id.encode()
                raw = txn.get(key, db=self._hints)
                if raw is not None:
                    try:
                        old = ScanRecord.from_json(bytes(raw))
                        if old.until > time.time() and old.since < rec.since:
                            rec = ScanRecord(old.since, rec.until, rec.passes, rec.current, rec.last)
                    except (ValueError, KeyError, TypeError):
                        pass
                txn.put(key, rec.to_json(), db=self._hints)

        self.index.write_txn(put)

    def scans(self, now: float | None = None) -> dict[str, ScanRecord]:
        """The scans in force: dataset id → record."""
        now = time.time() if now is None else now
        out = {}
        for ds_id, raw in self._prefixed(_SCAN):
            try:
                rec = ScanRecord.from_json(raw)
            except (ValueError, KeyError, TypeError):
                continue
            if rec.until > now:
                out[ds_id.decode()] = rec
        return out

    # -- pins -----------------------------------------------------------------------------------------------
    def set_pins(self, source: str, datasets: set[str] | frozenset[str]) -> None:
        """``source``'s pins are ``datasets`` from now on (pins of other sources stay)."""
        mine = {k for k, _ in self._prefixed(_PIN) if k.rpartition(b"\0")[2] == source.encode()}
        want = {d.encode() + b"\0" + source.encode() for d in datasets}
        if mine == want:
            return

        def put(txn) -> None:
            for k in mine - want:
                txn.delete(_PIN + k, db=self._hints)
            for k in want - mine:
                txn.put(_PIN + k, _SINCE.pack(time.time()), db=self._hints)

        self.index.write_txn(put)

    def pin(self, dataset: str, source: str = "cli") -> None:
        self.set_pins(source, self.pins_of(source) | {dataset})

    def unpin(self, dataset: str, source: str = "cli") -> None:
        self.set_pins(source, self.pins_of(source) - {dataset})

    def pins_of(self, source: str) -> frozenset[str]:
        return frozenset(k.rpartition(b"\0")[0].decode() for k, _ in self._prefixed(_PIN)
                         if k.rpartition(b"\0")[2] == source.encode())

    def pinned(self) -> frozenset[str]:
        """Every dataset some source pins."""
        return frozenset(self.pins())

    def pins(self) -> dict[str, list[str]]:
        """The pinned datasets and, for each, the sources that pin it."""
        out: dict[str, list[str]] = {}
        for k, _ in self._prefixed(_PIN):
            ds, _, source = k.rpartition(b"\0")
            out.setdefault(ds.decode(), []).append(source.decode())
        return out

    # -- staged bytes ---------------------------------------------------------------------------------------
    def stage(self, key: bytes, nbytes: int) -> None:
        self.index.write_txn(lambda txn: txn.put(key, _STAGED.pack(nbytes), db=self._staged))

    def unstage(self, key: bytes) -> None:
        self.index.write_txn(lambda txn: txn.delete(key, db=self._staged))

    def staged(self) -> frozenset[bytes]:
        with self.index.env.begin() as txn:
            return frozenset(bytes(k) for k, _v in txn.cursor(db=self._staged))

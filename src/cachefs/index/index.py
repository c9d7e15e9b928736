"""The node's index of what is cached: blocks present per object version, object access statistics, per-dataset
and total byte counts. Backed by LMDB so that every process on the node sees one consistent picture and a
crash never leaves a half-updated record (each update is one transaction)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator

import lmdb

from cachefs.base.errors import CacheFSError, CacheFullError
from cachefs.index.env import open_env
from cachefs.index.records import (
    BLOCK,
    DIR_HEAT,
    DS_STATS,
    EVICTED,
    FORMAT_VERSION,
    PACKED,
    TOTALS,
    DatasetRecord,
    DatasetStats,
    ManifestInfo,
    ObjectRecord,
    PackRecord,
    pack_key,
)
from cachefs.index.reserve import IndexReserve, reserve_size

__all__ = ["DatasetRecord", "DatasetStats", "Index", "ManifestInfo"]


def _bkey(okey: bytes, idx: int) -> bytes:
    return okey + idx.to_bytes(4, "big")


class Index:
    """Handle on ``<cache_dir>/index``; cheap to create, shares the process-wide LMDB environment."""

    def __init__(self, cache_dir: str) -> None:
        self.path = os.path.join(cache_dir, "index")
        self.env, dbs = open_env(self.path)
        self.dbs = dbs
        self._meta, self._datasets, self._ds_stats = dbs["meta"], dbs["datasets"], dbs["ds_stats"]
        self._objects, self._blocks, self.manifest_db = dbs["objects"], dbs["blocks"], dbs["manifest"]
        self._packed, self._packs, self._members = dbs["packed"], dbs["packs"], dbs["pack_members"]
        self._dir_heat = dbs["dir_heat"]
        # Guest data (another group member owns it; evicted first): keys of the blocks db (object key + block
        # index, 20 bytes) and of the packs db (24 bytes), empty values.
        self._guests = dbs["guests"]
        self.reserve = IndexReserve(os.path.join(self.path, "reserve"))
        self._check_format()

    def _check_format(self) -> None:
        with self.env.begin() as txn:
            raw = txn.get(b"format", db=self._meta)
        if raw is None:
            self._write(lambda txn: txn.put(b"format", str(FORMAT_VERSION).encode(), db=self._meta))
        elif int(raw) != FORMAT_VERSION:
            raise CacheFSError(
                f"cache index {self.path} has format {int(raw)}, this cachefs reads {FORMAT_VERSION}; "
                "point --cache-dir elsewhere or remove the old cache"
            )

    def write_txn(self, body):
        """:meth:`_write` for callers outside the index (the manifest store): ``body(txn)`` in one write
        transaction, a full disk as :class:`CacheFullError`."""
        return self._write(body)

    def _write(self, body):
        """Run ``body(txn)`` in one write transaction and return what it returns. A full disk raises
        :class:`CacheFullError` (after the reserve was spent on one more try); nothing is half-written."""
        for attempt in (0, 1):
            try:
                with self.env.begin(write=True) as txn:
                    return body(txn)
            except lmdb.Error as exc:
                if not self._disk_full(exc):
                    raise CacheFSError(f"cache index {self.path}: {exc}") from None
                if attempt == 0 and self.reserve.release():
                    continue
                raise CacheFullError(f"cache disk full: the index at {self.path} cannot commit") from None
        raise AssertionError("unreachable")

    def _disk_full(self, exc: lmdb.Error) -> bool:
        """Whether a failed commit failed for lack of space: ENOSPC or EDQUOT, or EIO (what LMDB reports for a
        short write) on a disk with next to nothing free."""
        if isinstance(exc, lmdb.DiskError) or "quota" in str(exc).lower():
            return True
        if "Input/output error" not in str(exc):
            return False
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 2 * reserve_size(st.f_blocks * st.f_frsize)

    def keep_reserve(self, disk_total: int, disk_free: int) -> bool:
        """Put the index's reserved space back if it was spent and the disk has room; True if it is there."""
        return self.reserve.restore(reserve_size(disk_total), disk_free)

    # -- datasets ---------------------------------------------------------------------------------------
    def dataset(self, ds_id: str) -> DatasetRecord | None:
        with self.env.begin() as txn:
            raw = txn.get(ds_id.encode(), db=self._datasets)
        return DatasetRecord.from_json(raw) if raw else None

    def put_dataset(self, rec: DatasetRecord) -> None:
        self._write(lambda txn: txn.put(rec.id.encode(), rec.to_json(), db=self._datasets))

    def datasets(self) -> list[DatasetRecord]:
        with self.env.begin() as txn:
            return [DatasetRecord.from_json(v) for _, v in txn.cursor(db=self._datasets)]

    def dataset_stats(self, ds_id: str) -> DatasetStats:
        with self.env.begin() as txn:
            raw = txn.get(ds_id.encode(), db=self._ds_stats)
        return DatasetStats(*DS_STATS.unpack(raw)) if raw else DatasetStats(0, 0, 0)

    def totals(self) -> tuple[int, int]:
        """(cached bytes, cached objects) over the whole node."""
        with self.env.begin() as txn:
            raw = txn.get(b"totals", db=self._meta)
        return TOTALS.unpack(raw) if raw else (0, 0)

    # -- blocks and objects -----------------------------------------------------------------------------
    def block(self, okey: bytes, idx: int) -> tuple[int, int] | None:
        """(checksum, length) of a present block, or None."""
        with self.env.begin() as txn:
            raw = txn.get(_bkey(okey, idx), db=self._blocks)
        return BLOCK.unpack(raw) if raw else None

    def blocks_of(self, okey: bytes) -> dict[int, tuple[int, int]]:
        out = {}
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._blocks)
            if cur.set_range(okey):
                for k, v in cur:
                    if k[:16] != okey:
                        break
                    out[int.from_bytes(k[16:], "big")] = BLOCK.unpack(v)
        return out

    def object(self, okey: bytes) -> ObjectRecord | None:
        with self.env.begin() as txn:
            raw = txn.get(okey, db=self._objects)
        return ObjectRecord.unpack(raw) if raw else None

    def put_block(self, okey: bytes, idx: int, checksum: int, length: int, obj: ObjectRecord, *,
                  guest: bool = False) -> bool:
        """Record a block as present (after its bytes are on disk); a ``guest`` block (another group member owns
        it) is evicted first. Returns False if it already was."""
        def body(txn):
            if not txn.put(_bkey(okey, idx), BLOCK.pack(checksum, length), db=self._blocks, overwrite=False):
                return False
            if guest:
                txn.put(_bkey(okey, idx), b"", db=self._guests)
            raw = txn.get(okey, db=self._objects)
            new_object = raw is None
            rec = obj if new_object else ObjectRecord.unpack(raw)
            if new_object:
                rec.cached_bytes = 0
                rec.last_access = time.time()
            rec.cached_bytes += length
            txn.put(okey, rec.pack(), db=self._objects)
            self._add_stats(txn, rec.dataset, cached=length)
            self._add_totals(txn, length, int(new_object))
            return True

        return self._write(body)

    def drop_block(self, okey: bytes, idx: int) -> None:
        """Forget one block (it failed its checksum); its bytes will be fetched again."""
        self._write(lambda txn: self._drop_blocks(txn, okey, [idx]))

    def _drop_blocks(self, txn, okey: bytes, idxs: list[int]) -> int:
        dropped = 0
        for idx in idxs:
            raw = txn.pop(_bkey(okey, idx), db=self._blocks)
            txn.delete(_bkey(okey, idx), db=self._guests)
            if raw is not None:
                dropped += BLOCK.unpack(raw)[1]
        obj_raw = txn.get(okey, db=self._objects)
        if obj_raw is not None and dropped:
            rec = ObjectRecord.unpack(obj_raw)
            rec.cached_bytes -= dropped
            txn.put(okey, rec.pack(), db=self._objects)
            self._add_stats(txn, rec.dataset, cached=-dropped)
        self._add_totals(txn, -dropped, 0)
        return dropped

    # -- guest data -----------------------------------------------------------------------------------------
    def guests(self) -> tuple[dict[bytes, list[int]], list[bytes]]:
        """Guest data: ({object key: its guest blocks}, [pack keys of guest packs])."""
        blocks: dict[bytes, list[int]] = {}
        packs: list[bytes] = []
        with self.env.begin() as txn:
            for k in txn.cursor(db=self._guests).iternext(values=False):
                k = bytes(k)
                if len(k) == 20:
                    blocks.setdefault(k[:16], []).append(int.from_bytes(k[16:], "big"))
                else:
                    packs.append(k)
        return blocks, packs

    def guest_bytes(self) -> int:
        """Bytes of guest data cached (blocks and whole packs)."""
        return sum(self.guest_bytes_by_dataset().values())

    def guest_bytes_by_dataset(self) -> dict[str, int]:
        """Bytes of guest data per dataset id."""
        out: dict[str, int] = {}
        datasets: dict[bytes, str] = {}  # object key → its dataset id
        with self.env.begin() as txn:
            for k in txn.cursor(db=self._guests).iternext(values=False):
                if len(k) == 20:
                    raw = txn.get(k, db=self._blocks)
                    okey = bytes(k[:16])
                    ds = datasets.get(okey)
                    if ds is None:
                        obj = txn.get(okey, db=self._objects)
                        ds = datasets[okey] = ObjectRecord.unpack(obj).dataset if obj is not None else ""
                    n = BLOCK.unpack(raw)[1] if raw is not None else 0
                else:
                    raw = txn.get(k, db=self._packs)
                    ds = bytes(k[:16]).decode()
                    n = PackRecord.unpack(bytes(k), raw).live_bytes if raw is not None else 0
                out[ds] = out.get(ds, 0) + n
        return out

    def evict_guest_blocks(self, okey: bytes, idxs: list[int]) -> int:
        """Forget guest blocks of an object whose file was rewritten without them (eviction); the object's
        record goes too once it has no block left. Returns the bytes forgotten."""
        def body(txn):
            dropped = self._drop_blocks(txn, okey, idxs)
            cur = txn.cursor(db=self._blocks)
            if not (cur.set_range(okey) and bytes(cur.key()[:16]) == okey):
                raw = txn.pop(okey, db=self._objects)
                if raw is not None:
                    self._add_totals(txn, 0, -1)
            if dropped:
                self._add_evicted(txn, dropped)
            return dropped

        return self._write(body)

    def remove_object(self, okey: bytes) -> int:
        """Forget an object and all its blocks (evicted); returns the bytes it held."""
        def body(txn):
            raw = txn.pop(okey, db=self._objects)
            if raw is None:
                return 0
            rec = ObjectRecord.unpack(raw)
            cur = txn.cursor(db=self._blocks)
            if cur.set_range(okey):
                while cur.key()[:16] == okey:
                    txn.delete(bytes(cur.key()), db=self._guests)
                    if not cur.delete():
                        break
            self._add_stats(txn, rec.dataset, cached=-rec.cached_bytes)
            self._add_totals(txn, -rec.cached_bytes, -1)
            self._add_evicted(txn, rec.cached_bytes)
            return rec.cached_bytes

        return self._write(body)

    def objects(self, dataset: str | None = None) -> Iterator[tuple[bytes, ObjectRecord]]:
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self._objects):
                rec = ObjectRecord.unpack(v)
                if dataset is None or rec.dataset == dataset:
                    yield bytes(k), rec

    # -- packs ------------------------------------------------------------------------------------------
    def packed(self, okey: bytes) -> tuple[int, int, int, int] | None:
        """(pack id, offset, length, checksum) of a packed object, or None."""
        with self.env.begin() as txn:
            raw = txn.get(okey, db=self._packed)
        return PACKED.unpack(raw) if raw else None

    def commit_pack(self, dataset: str, pack_id: int, size: int, members: list[tuple[bytes, int, int, int]], *,
                    guest: bool = False) -> int:
        """Record a pack file (already complete on disk) and point its members' keys at it. A member another
        process packed first keeps its record (this pack's copy is dead weight until the pack is evicted). A
        ``guest`` pack (small files other group members own) is evicted first. Returns how many members were
        recorded."""
        pkey = pack_key(dataset, pack_id)

        def body(txn):
            if guest:
                txn.put(pkey, b"", db=self._guests)
            live = count = 0
            for okey, offset, length, checksum in members:
                if txn.put(okey, PACKED.pack(pack_id, offset, length, checksum), db=self._packed, overwrite=False):
                    txn.put(pkey + okey, b"", db=self._members)
                    live += length
                    count += 1
            rec = PackRecord(dataset, pack_id, size, live, count, last_access=time.time())
            txn.put(pkey, rec.pack(), db=self._packs)
            self._add_stats(txn, dataset, cached=live)
            self._add_totals(txn, size, count)
            return count

        return self._write(body)

    def drop_packed(self, dataset: str, okey: bytes) -> None:
        """Forget one packed member (it failed its checksum); it will be fetched again."""
        def body(txn):
            raw = txn.pop(okey, db=self._packed)
            if raw is None:
                return
            pack_id, _off, length, _ck = PACKED.unpack(raw)
            pkey = pack_key(dataset, pack_id)
            txn.delete(pkey + okey, db=self._members)
            praw = txn.get(pkey, db=self._packs)
            if praw is not None:
                rec = PackRecord.unpack(pkey, praw)
                rec.live_bytes, rec.members = max(0, rec.live_bytes - length), max(0, rec.members - 1)
                txn.put(pkey, rec.pack(), db=self._packs)
            self._add_stats(txn, dataset, cached=-length)
            self._add_totals(txn, 0, -1)

        return self._write(body)

    def has_pack(self, dataset: str, pack_id: int) -> bool:
        with self.env.begin() as txn:
            return txn.get(pack_key(dataset, pack_id), db=self._packs) is not None

    def pack(self, pkey: bytes) -> PackRecord | None:
        with self.env.begin() as txn:
            raw = txn.get(pkey, db=self._packs)
        return PackRecord.unpack(pkey, raw) if raw is not None else None

    def packs(self, dataset: str | None = None) -> Iterator[PackRecord]:
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._packs)
            if dataset is not None and not cur.set_range(dataset.encode()):
                return
            for k, v in (cur.iternext() if dataset is not None else cur):
                rec = PackRecord.unpack(k, v)
                if dataset is not None and rec.dataset != dataset:
                    break
                yield rec

    def remove_pack(self, dataset: str, pack_id: int, *, evicted: bool = True) -> int:
        """Forget a pack and every member still pointing into it (``evicted``, or found gone from the disk);
        returns its size on disk (0 if unknown)."""
        pkey = pack_key(dataset, pack_id)
        def body(txn):
            raw = txn.pop(pkey, db=self._packs)
            txn.delete(pkey, db=self._guests)
            if raw is None:
                return 0
            rec = PackRecord.unpack(pkey, raw)
            cur = txn.cursor(db=self._members)
            gone = 0
            if cur.set_range(pkey):
                while cur.key()[:24] == pkey:
                    okey = bytes(cur.key()[24:])
                    praw = txn.get(okey, db=self._packed)
                    if praw is not None and PACKED.unpack(praw)[0] == pack_id:
                        txn.delete(okey, db=self._packed)
                        gone += 1
                    if not cur.delete():
                        break
            self._add_stats(txn, dataset, cached=-rec.live_bytes)
            self._add_totals(txn, -rec.size, -gone)
            if evicted:
                self._add_evicted(txn, rec.size)
            return rec.size

        return self._write(body)

    # -- hot directories ----------------------------------------------------------------------------------
    def hot_directories(self, half_life: float, limit: int = 20, now: float | None = None) -> list[dict]:
        """The directories read most lately: access counts decayed with ``half_life`` seconds, highest first."""
        now = time.time() if now is None else now
        out = []
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self._dir_heat):
                score, updated = DIR_HEAT.unpack(v)
                k = bytes(k)
                out.append((score * math.exp2(-(now - updated) / half_life), k[:16].decode(), k[16:].decode()))
        out.sort(reverse=True)
        return [{"dataset": ds, "path": path, "score": round(score, 3)} for score, ds, path in out[:limit]]

    def record_access(
        self, objects: dict[bytes, tuple[float, int]], datasets: dict[str, tuple[int, int]],
        packs: dict[bytes, tuple[float, int]] | None = None, dirs: dict[tuple[str, str], int] | None = None,
        half_life: float = 600.0,
    ) -> None:
        """Fold batched access statistics in: per object and per pack (last access, hit count delta), per
        dataset (hit bytes, miss bytes), per directory (accesses, added to a score that halves every
        ``half_life`` seconds)."""
        if not (objects or datasets or packs or dirs):
            return
        def body(txn):
            for pkey, (last, hits) in (packs or {}).items():
                raw = txn.get(pkey, db=self._packs)
                if raw is None:
                    continue
                rec = PackRecord.unpack(pkey, raw)
                rec.last_access, rec.hits = max(rec.last_access, last), rec.hits + hits
                txn.put(pkey, rec.pack(), db=self._packs)
            now = time.time()
            for (ds, path), hits in (dirs or {}).items():
                key = ds.encode() + path.encode()
                raw = txn.get(key, db=self._dir_heat)
                score, updated = DIR_HEAT.unpack(raw) if raw else (0.0, now)
                txn.put(key, DIR_HEAT.pack(score * math.exp2(-(now - updated) / half_life) + hits, now),
                        db=self._dir_heat)
            for okey, (last, hits) in objects.items():
                raw = txn.get(okey, db=self._objects)
                if raw is None:
                    continue
                obj = ObjectRecord.unpack(raw)
                obj.last_access = max(obj.last_access, last)
                obj.hits += hits
                txn.put(okey, obj.pack(), db=self._objects)
            for ds, (hit, miss) in datasets.items():
                self._add_stats(txn, ds, hit=hit, miss=miss)

        return self._write(body)

    def evicted(self) -> tuple[int, int]:
        """(objects and packs evicted, bytes they held) since the index was made."""
        with self.env.begin() as txn:
            raw = txn.get(b"evicted", db=self._meta)
        return EVICTED.unpack(raw) if raw else (0, 0)

    def _add_evicted(self, txn, nbytes: int) -> None:
        count, total = EVICTED.unpack(txn.get(b"evicted", db=self._meta) or EVICTED.pack(0, 0))
        txn.put(b"evicted", EVICTED.pack(count + 1, total + nbytes), db=self._meta)

    def _add_totals(self, txn, nbytes: int, objects: int) -> None:
        """Add to the node's cached bytes and object count (never below zero)."""
        total, count = TOTALS.unpack(txn.get(b"totals", db=self._meta) or TOTALS.pack(0, 0))
        txn.put(b"totals", TOTALS.pack(max(0, total + nbytes), max(0, count + objects)), db=self._meta)

    def _add_stats(self, txn, ds: str, cached: int = 0, hit: int = 0, miss: int = 0) -> None:
        key = ds.encode()
        c, h, m = DS_STATS.unpack(txn.get(key, db=self._ds_stats) or DS_STATS.pack(0, 0, 0))
        txn.put(key, DS_STATS.pack(max(0, c + cached), h + hit, m + miss), db=self._ds_stats)

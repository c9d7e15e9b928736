"""Access statistics of the read paths, batched in memory and folded into the index every
``engine.stats_flush_interval`` seconds: per dataset the hit and miss bytes (what ``cachefs status`` and the
metrics report), per object and pack the last access and access count (what eviction ranks by), per
directory an access count (hot directories).

A hit is a byte that was on this node before a reader asked for it; a miss, one fetched from the origin for a
reader, by read-ahead included (docs/SEMANTICS.md, "Hits and misses").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from cachefs.base.errors import CacheFSError, CacheFullError
from cachefs.index import Index
from cachefs.node.scan import ScanDetector

__all__ = ["ReadStats"]

log = logging.getLogger(__name__)


class ReadStats:
    """Thread-safe counters; :meth:`flush` writes them to the index."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._datasets: dict[str, list[int]] = {}  # dataset id → [hit bytes, miss bytes]
        self._dirs: dict[tuple[str, str], int] = {}  # (dataset id, directory) → accesses
        self._packs: dict[bytes, list] = {}  # pack key → [last access, reads]
        #: Bytes served in this process since start, by (file kind, hit or miss): what the metrics report.
        self.served: dict[tuple[str, str], int] = {}
        #: What read-ahead brought that no reader was served yet (its first serving is a miss): small files by
        #: object key (directory read-ahead, the rest of a mirror window), and blocks of large files.
        self._came_ahead: set[bytes] = set()
        self._blocks_ahead: dict[bytes, set[int]] = {}
        #: Cached bytes that failed their checksum on this node's disk since start, by file kind (block, small):
        #: a disk that rots shows here (cachefs_corrupt_reads_total, cachefs status).
        self.corrupt: dict[str, int] = {}
        #: Which datasets this process's readers read as epoch scans (:mod:`cachefs.node.scan`).
        self.scans = ScanDetector()

    def count(self, ds_id: str, accessed_path: str | None, hit: int, miss: int, kind: str = "block") -> None:
        """Hit and miss bytes of a dataset (``kind``: a ``block`` or a ``small`` file's), and (``accessed_path``)
        one access of that file's directory."""
        with self._lock:
            s = self._datasets.get(ds_id)
            if s is None:
                s = self._datasets[ds_id] = [0, 0]
            s[0] += hit
            s[1] += miss
            self.scans.note(ds_id, accessed_path, hit, miss)
            if hit:
                self.served[kind, "hit"] = self.served.get((kind, "hit"), 0) + hit
            if miss:
                self.served[kind, "miss"] = self.served.get((kind, "miss"), 0) + miss
            if accessed_path is not None:
                key = (ds_id, accessed_path.rpartition("/")[0])
                self._dirs[key] = self._dirs.get(key, 0) + 1

    def pack_read(self, pkey: bytes) -> None:
        with self._lock:
            acc = self._packs.get(pkey)
            if acc is None:
                acc = self._packs[pkey] = [0.0, 0]
            acc[0], acc[1] = time.time(), acc[1] + 1

    def note_corrupt(self, kind: str) -> None:
        with self._lock:
            self.corrupt[kind] = self.corrupt.get(kind, 0) + 1

    def note_ahead(self, okeys: Iterable[bytes]) -> None:
        """These small files came by read-ahead."""
        with self._lock:
            if len(self._came_ahead) > 1 << 20:  # bounded; forgetting one only counts its first read as a hit
                self._came_ahead.clear()
            self._came_ahead.update(okeys)

    def unread_ahead(self, okey: bytes) -> bool:
        """Whether ``okey`` came by read-ahead and no reader was served it yet."""
        with self._lock:
            return okey in self._came_ahead

    def take_ahead(self, okey: bytes) -> bool:
        """Whether ``okey`` came by read-ahead and this is its first read (then no longer)."""
        if not self._came_ahead:
            return False
        with self._lock:
            if okey not in self._came_ahead:
                return False
            self._came_ahead.discard(okey)
            return True

    def note_block_ahead(self, okey: bytes, idx: int) -> None:
        """Block ``idx`` of object ``okey`` is being read ahead (noted before its bytes are visible, so that a
        reader counts a miss, not a hit)."""
        with self._lock:
            if len(self._blocks_ahead) > 1 << 16:
                self._blocks_ahead.clear()
            self._blocks_ahead.setdefault(okey, set()).add(idx)

    def forget_block_ahead(self, okey: bytes, idx: int) -> None:
        """Block ``idx`` did not come after all (its fetch failed, or another brought it first)."""
        with self._lock:
            blocks = self._blocks_ahead.get(okey)
            if blocks is not None:
                blocks.discard(idx)
                if not blocks:
                    del self._blocks_ahead[okey]

    def block_ahead(self, okey: bytes, idx: int) -> bool:
        """Whether block ``idx`` of ``okey`` is being read ahead (no reader has been served it)."""
        with self._lock:
            return idx in self._blocks_ahead.get(okey, ())

    def any_block_ahead(self, okey: bytes) -> bool:
        return okey in self._blocks_ahead

    def take_blocks_ahead(self, okey: bytes, start: int, end: int, block_size: int, size: int) -> int:
        """Bytes of ``[start, end)`` of ``okey`` in blocks read-ahead brought for a reader who had not got to them
        yet: misses (the origin was read for this reader, only earlier). A block stops counting so once a read has
        reached its end; from then on it is an ordinary cached block."""
        if okey not in self._blocks_ahead:
            return 0
        n = 0
        with self._lock:
            blocks = self._blocks_ahead.get(okey)
            if not blocks:
                return 0
            for i in range(start // block_size, (end - 1) // block_size + 1):
                if i in blocks:
                    hi = min((i + 1) * block_size, size)
                    if end >= hi:
                        blocks.discard(i)
                    n += min(end, hi) - max(start, i * block_size)
            if not blocks:
                del self._blocks_ahead[okey]
        return n

    def presume_scan(self, ds_id: str) -> None:
        """:meth:`ScanDetector.presume`."""
        with self._lock:
            self.scans.presume(ds_id)

    def scan_records(self) -> dict:
        """This process's scans, to publish (:meth:`ScanDetector.records`)."""
        with self._lock:
            return self.scans.records()

    def totals(self) -> dict[str, tuple[int, int]]:
        """Hit and miss bytes per dataset not yet flushed (a peek)."""
        with self._lock:
            return {k: (v[0], v[1]) for k, v in self._datasets.items()}

    def flush(self, index: Index, objects: dict[bytes, tuple[float, int]], half_life: float) -> None:
        """Fold the counters and ``objects`` ((last access, accesses) per object) into the index. On a full disk
        these figures are dropped (logged); the next flush carries on."""
        with self._lock:
            ds = {k: (v[0], v[1]) for k, v in self._datasets.items() if v[0] or v[1]}
            dirs, packs = self._dirs, {k: (v[0], v[1]) for k, v in self._packs.items()}
            self._datasets, self._dirs, self._packs = {}, {}, {}
        try:
            index.record_access(objects, ds, packs, dirs, half_life=half_life)
        except CacheFullError as exc:
            log.warning("access statistics not recorded: %s", exc)
        except CacheFSError as exc:
            log.error("access statistics not recorded: %s", exc)

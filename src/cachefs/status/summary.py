"""What this node holds, read straight from the index: capacity, usage, per-dataset figures, hot
directories and mounts (``cachefs status``, the label publisher, the metrics).

Read-only: no engine is built, nothing is fetched, written or cleaned up, and a cache directory that does not
exist is reported as such (:class:`~cachefs.base.errors.ObjectNotFoundError`), never created.
"""

from __future__ import annotations

import json
import os
import time

from cachefs.base.config import Config, resolve_size
from cachefs.base.errors import ObjectNotFoundError
from cachefs.base.files import atomic_write
from cachefs.base.types import object_key
from cachefs.index import Index
from cachefs.index.counters import NodeCounters
from cachefs.index.hints import HintStore, ScanRecord
from cachefs.index.listings import listings_under_way
from cachefs.index.mounts import left_behind, list_mounts
from cachefs.index.orders import list_orders, read_order
from cachefs.index.volumes import list_volumes
from cachefs.manifest import ManifestStore

__all__ = ["HEAT_STALE_AFTER", "NodeSummary", "cluster_report", "heat_path", "status_report", "write_heat"]

#: The agent rewrites its heat file every few seconds; older than this, the agent is gone and it is ignored.
HEAT_STALE_AFTER = 120.0


def heat_path(cache_dir: str) -> str:
    """What the node's agent served its group and its hot directories (written by the agent)."""
    return os.path.join(cache_dir, "cluster", "heat.json")


def write_heat(cache_dir: str, served_requests: int, served_bytes: int, hot: list[dict]) -> None:
    """Write the heat file atomically (the agent, every few seconds)."""
    doc = {"written_at": time.time(), "served_requests": served_requests, "served_bytes": served_bytes, "hot": hot}
    atomic_write(heat_path(cache_dir), json.dumps(doc), dir_mode=0o700)


def cluster_report(cache_dir: str) -> dict | None:
    """The node's cache group as its agent last wrote it: group, members, what it served its peers and the hot
    directories with their replica counts; None when no live agent wrote one."""
    try:
        with open(os.path.join(cache_dir, "cluster", "members.json")) as f:
            members = json.load(f)
        with open(heat_path(cache_dir)) as f:
            heat = json.load(f)
        if time.time() - float(heat["written_at"]) > HEAT_STALE_AFTER:
            return None
        return {"group": str(members["group"]), "node": str(members["self"]),
                "members": len(members["members"]),
                "draining": sorted(str(m["name"]) for m in members["members"] if m.get("draining")),
                "served_requests": int(heat["served_requests"]), "served_bytes": int(heat["served_bytes"]),
                "hot_keys": list(heat["hot"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


#: Seconds a long-lived summary keeps a dataset's bytes of earlier manifests before walking them again.
OLD_BYTES_TTL = 60.0


class NodeSummary:
    """A read-only view of one cache directory's index."""

    def __init__(self, config: Config) -> None:
        self.config = config
        d = config.cache.dir
        if not os.path.isfile(os.path.join(d, "index", "data.mdb")):
            raise ObjectNotFoundError(f"no cache at {d} (nothing was cached there; is --cache-dir right?)")
        self.index = Index(d)
        self._old_bytes: dict[str, tuple[tuple[int, ...], float, int]] = {}  # dataset id → (versions, when, bytes)

    def disk(self) -> tuple[int, int]:
        """(total, free) bytes of the cache's file system."""
        st = os.statvfs(self.config.cache.dir)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def _old_version_bytes(self, rec) -> int:
        """Cached bytes of files of ``rec``'s earlier manifests whose version its current manifest does not name.
        Walks the earlier manifests (only a refreshed dataset has any): a lookup in the current one per file; a
        long-lived summary (the metrics collector, the label publisher) walks them again only every
        :data:`OLD_BYTES_TTL` seconds or when the manifests change."""
        if len(rec.manifests) < 2:
            return 0
        versions = tuple(m.version for m in rec.manifests)
        known = self._old_bytes.get(rec.id)
        if known is not None and known[0] == versions and time.monotonic() - known[1] < OLD_BYTES_TTL:
            return known[2]
        total = self._walk_old_versions(rec)
        self._old_bytes[rec.id] = (versions, time.monotonic(), total)
        return total

    def _walk_old_versions(self, rec) -> int:
        store = ManifestStore(self.index)
        seen: set[bytes] = set()
        total = 0
        for m in rec.manifests:
            if m.version == rec.current:
                continue
            for e in store.walk_files(rec.id, m.version):
                try:
                    if store.lookup(rec.id, rec.current, e.path).version == e.version:
                        continue
                except ObjectNotFoundError:
                    pass  # (deleted at the origin since)
                okey = object_key(rec.id, e.path, e.version)
                if okey not in seen:
                    seen.add(okey)
                    total += self._cached_bytes_of(okey)
        return total

    def _cached_bytes_of(self, okey: bytes) -> int:
        obj = self.index.object(okey)
        if obj is not None:
            return obj.cached_bytes
        packed = self.index.packed(okey)
        return packed[2] if packed is not None else 0

    def report(self) -> dict:
        """What ``cachefs status --json`` prints."""
        c = self.config.cache
        total, objects = self.index.totals()
        disk_total, disk_free = self.disk()
        datasets = []
        urls = {}
        guests = self.index.guest_bytes_by_dataset()
        hints = HintStore(self.index)
        scans = hints.scans() if c.scan_admission else {}
        pins = hints.pins()
        for rec in self.index.datasets():
            urls[rec.id] = rec.url
            m = rec.manifest()
            st = self.index.dataset_stats(rec.id)
            old = self._old_version_bytes(rec)
            cached = max(0, st.cached_bytes - old)
            size = m.bytes if m else 0
            served = st.hit_bytes + st.miss_bytes
            datasets.append({
                "url": rec.url,
                "id": rec.id,
                "manifest_version": rec.current,
                "manifest_versions": [v.version for v in rec.manifests],
                "files": m.files if m else 0,
                "skipped_names": m.skipped if m else 0,
                "total_bytes": size,
                "cached_bytes": cached,
                # Bytes of versions the current manifest no longer names (changed or deleted at the origin), still
                # cached for readers of an earlier manifest (a mount serves the version it started with).
                "old_version_bytes": old,
                # Of which guest data: copies of what other members of the node's cache group own (evicted first).
                "guest_bytes": min(cached, guests.get(rec.id, 0)),
                "cached_fraction": round(min(1.0, cached / size), 4) if size else 1.0,
                # Hits: bytes read that were on this node before the read asked for them (an earlier read or
                # a prefetch brought them). Misses: bytes fetched for a read, read-ahead for it included.
                "hit_bytes": st.hit_bytes,
                "miss_bytes": st.miss_bytes,
                "hit_ratio": round(st.hit_bytes / served, 4) if served else None,
                **_epoch_figures(scans.get(rec.id), cached),
                # Who keeps it from eviction (cachefs pin: "cli"; a CacheDataset's spec.pin: "cachedatasets").
                "pinned_by": sorted(pins.get(rec.id, [])),
                # Read orders jobs published for it (cachefs order): each publisher's epoch and length.
                "orders": _orders(c.dir, rec.id),
            })
        capacity, min_free = (resolve_size(c.capacity, disk_total, "cache.capacity"),
                              resolve_size(c.min_free, disk_total, "cache.min_free"))
        return {
            "cache_dir": c.dir,
            "capacity_bytes": capacity,
            # What the cache can really hold now: its capacity, or less when the disk's free space (less the floor
            # kept free) runs out first (other tenants of the disk).
            "usable_bytes": min(capacity, total + max(0, disk_free - min_free)),
            "used_bytes": total,
            "objects": objects,
            "disk_total_bytes": disk_total,
            "disk_free_bytes": disk_free,
            "min_free_bytes": min_free,
            "datasets": datasets,
            # Directories read most lately (access counts that halve every engine.hot_dir_half_life seconds).
            "hot_directories": [{**d, "url": urls.get(d["dataset"], "")} for d in
                                self.index.hot_directories(self.config.engine.hot_dir_half_life)],
            "mounts": list_mounts(c.dir),
            # Sessions this node pod generation left with an earlier one it could not take them from (and why).
            "left_with_previous_generation": left_behind(c.dir),
            # Listings of the origin running now (a dataset's first manifest, a refresh): what they found so far.
            "listings": listings_under_way(c.dir),
            # Writable checkpoint volumes: staged bytes, the upload's progress and failures (docs/SEMANTICS.md).
            "volumes": list_volumes(c.dir),
            # The cache group, from what the node's agent wrote (None outside a group, or without an agent).
            "cluster": self.cluster(urls),
            # Bytes served to readers of this cache directory by where they came from (every process adds to these
            # in the index; a file read by FUSE passthrough counts whole, at its open).
            "tier_bytes": NodeCounters(self.index).read("tier:"),
            # Cached blocks and small files that failed their checksum on this node's disk (dropped, fetched
            # again), by file kind: a disk that rots shows here.
            "corrupt_reads": NodeCounters(self.index).read("corrupt:"),
        }


    def cluster(self, urls: dict[str, str] | None = None) -> dict | None:
        rep = cluster_report(self.config.cache.dir)
        if rep is not None and urls is not None:
            for k in rep["hot_keys"]:
                k["url"] = urls.get(k.get("dataset", ""), "")
        return rep


def _ratio(pair: tuple[int, int] | None) -> float | None:
    if not pair or not sum(pair):
        return None
    return round(pair[0] / sum(pair), 4)


def _orders(cache_dir: str, ds_id: str) -> list[dict]:
    out = []
    for f in list_orders(cache_dir, ds_id):
        got = read_order(f.path)
        if got is not None:
            out.append({"publisher": f.publisher, "epoch": got[0], "files": len(got[1]), "published_at": f.stamp[0]})
    return out


def _epoch_figures(scan: ScanRecord | None, cached: int) -> dict:
    """The policy in force for a dataset (``lru``: two-touch LRU; ``pinned``: read as an epoch scan, what it has
    cached stays and the rest passes through: docs/SEMANTICS.md) and, when pinned, the epochs seen and the hit
    ratio of the current and the last one."""
    if scan is None:
        return {"policy": "lru", "pinned_bytes": 0, "epochs": None, "epoch_hit_ratio": None,
                "last_epoch_hit_ratio": None}
    return {"policy": "pinned", "pinned_bytes": cached, "epochs": scan.passes,
            "epoch_hit_ratio": _ratio(scan.current), "last_epoch_hit_ratio": _ratio(scan.last)}


def status_report(config: Config) -> dict:
    """:meth:`NodeSummary.report` of ``config``'s cache directory."""
    return NodeSummary(config).report()

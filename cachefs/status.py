"""The node's cache status: capacity, usage and per-dataset figures (``cachefs status``, the label publisher)."""

from __future__ import annotations

from .engine import Engine
from .fuse.registry import list_mounts

__all__ = ["status_report"]


def status_report(engine: Engine) -> dict:
    """What ``cachefs status --json`` prints: node capacity and usage, and per-dataset figures."""
    engine.flush_stats()
    total, objects = engine.index.totals()
    disk_total, disk_free = engine.store.disk_usage()
    datasets = []
    urls = {}
    for rec in engine.index.datasets():
        urls[rec.id] = rec.url
        m = rec.manifest()
        st = engine.index.dataset_stats(rec.id)
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
            "cached_bytes": st.cached_bytes,
            "cached_fraction": round(min(1.0, st.cached_bytes / size), 4) if size else 1.0,
            "hit_bytes": st.hit_bytes,
            "miss_bytes": st.miss_bytes,
            "hit_ratio": round(st.hit_bytes / served, 4) if served else None,
        })
    return {
        "cache_dir": engine.config.cache.dir,
        "capacity_bytes": engine.capacity,
        "used_bytes": total,
        "objects": objects,
        "disk_total_bytes": disk_total,
        "disk_free_bytes": disk_free,
        "min_free_bytes": engine.min_free,
        "datasets": datasets,
        # Directories read most lately (access counts that halve every engine.hot_dir_half_life seconds).
        "hot_directories": [{**d, "url": urls.get(d["dataset"], "")} for d in
                            engine.index.hot_directories(engine.config.engine.hot_dir_half_life)],
        "mounts": list_mounts(engine.config.cache.dir),
    }

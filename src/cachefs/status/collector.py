"""What the whole node holds, as Prometheus metrics read from the index at scrape time: the same figures
``cachefs status`` prints (:class:`~cachefs.status.summary.NodeSummary`), so the two never disagree."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cachefs.base.config import Config
from cachefs.base.errors import ObjectNotFoundError
from cachefs.status.summary import NodeSummary

__all__ = ["NodeCollector"]


class NodeCollector:
    """A prometheus-client collector over one cache directory (nothing is written, an absent cache is empty)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._summary: NodeSummary | None = None

    def _node(self) -> NodeSummary | None:
        if self._summary is None:
            try:
                self._summary = NodeSummary(self.config)
            except ObjectNotFoundError:
                return None
        return self._summary

    def describe(self):
        return []  # (collected at scrape time; prometheus-client then skips the describe-time collect)

    def collect(self):
        node = self._node()
        if node is None:
            return
        rep = node.report()
        for name, doc, key in (("cachefs_cache_capacity_bytes", "The cache's capacity", "capacity_bytes"),
                               ("cachefs_cache_used_bytes", "Bytes cached on this node", "used_bytes"),
                               ("cachefs_cache_disk_free_bytes", "Free space of the cache's file system",
                                "disk_free_bytes"),
                               ("cachefs_cache_min_free_bytes", "The free-space floor the cache keeps",
                                "min_free_bytes"),
                               ("cachefs_cache_objects", "Objects and packed files cached on this node", "objects")):
            yield GaugeMetricFamily(name, doc, value=rep[key])
        cached = GaugeMetricFamily("cachefs_dataset_cached_bytes", "Bytes of a dataset cached on this node",
                                   labels=["dataset"])
        size = GaugeMetricFamily("cachefs_dataset_size_bytes", "A dataset's size (its current manifest)",
                                 labels=["dataset"])
        served = CounterMetricFamily("cachefs_dataset_read_bytes", "Bytes of a dataset served to readers on this "
                                     "node: hit (on the node before the read asked) or miss (fetched for it)",
                                     labels=["dataset", "result"])
        pinned = GaugeMetricFamily("cachefs_dataset_pinned_bytes", "Bytes of a dataset read as an epoch scan that "
                                   "stay cached while the scan lasts (0 under LRU)", labels=["dataset"])
        policy = GaugeMetricFamily("cachefs_dataset_policy", "The caching policy in force for a dataset (1 for the "
                                   "one in force: lru or pinned; ordered besides while an order is published)",
                                   labels=["dataset", "policy"])
        orders = GaugeMetricFamily("cachefs_dataset_orders", "Read orders published for a dataset and in force "
                                   "(cachefs order; files are fetched ahead of their readers in that order)",
                                   labels=["dataset"])
        epoch = GaugeMetricFamily("cachefs_dataset_epoch_hit_ratio", "Byte hit ratio of a scanned dataset's current "
                                  "and last epoch", labels=["dataset", "epoch"])
        for d in rep["datasets"]:
            pinned.add_metric([d["url"]], d["pinned_bytes"])
            for name in ("lru", "pinned"):
                policy.add_metric([d["url"], name], 1 if d["policy"] == name else 0)
            policy.add_metric([d["url"], "ordered"], 1 if d["orders"] else 0)
            orders.add_metric([d["url"]], len(d["orders"]))
            for label, key in (("current", "epoch_hit_ratio"), ("last", "last_epoch_hit_ratio")):
                if d[key] is not None:
                    epoch.add_metric([d["url"], label], d[key])
            cached.add_metric([d["url"]], d["cached_bytes"])
            size.add_metric([d["url"]], d["total_bytes"])
            served.add_metric([d["url"], "hit"], d["hit_bytes"])
            served.add_metric([d["url"], "miss"], d["miss_bytes"])
        yield from (cached, size, served, pinned, policy, epoch, orders)
        listing = GaugeMetricFamily("cachefs_dataset_listing_files", "Files a listing of the origin running now (a "
                                    "dataset's first manifest, a refresh) has found so far", labels=["dataset"])
        for li in rep.get("listings", ()):
            listing.add_metric([li["url"]], li["files"])
        yield listing
        count, nbytes = node.index.evicted()
        yield CounterMetricFamily("cachefs_evictions", "Objects and packs evicted from this node's cache", value=count)
        yield CounterMetricFamily("cachefs_evicted_bytes", "Bytes evicted from this node's cache", value=nbytes)
        mounts = GaugeMetricFamily("cachefs_mounts", "Mounts of this cache, by state", labels=["state"])
        states: dict[str, int] = {}
        for m in rep["mounts"]:
            states[m.get("state", "serving")] = states.get(m.get("state", "serving"), 0) + 1
        for state, n in sorted(states.items()):
            mounts.add_metric([state], n)
        yield mounts
        group = node.cluster()
        if group is not None:
            yield CounterMetricFamily("cachefs_peer_served_requests", "Blocks and small files this node's agent "
                                      "served its cache group", value=group["served_requests"])
            yield CounterMetricFamily("cachefs_peer_served_bytes", "Bytes this node's agent served its cache group",
                                      value=group["served_bytes"])
            yield GaugeMetricFamily("cachefs_hot_directories", "Directories this node serves that are hot "
                                    "(spread over extra holders)", value=len(group["hot_keys"]))
            replicas = GaugeMetricFamily("cachefs_hot_directory_replicas", "Extra holders of a hot directory's "
                                         "keys, by dataset and directory", labels=["dataset", "directory"])
            for k in group["hot_keys"][:32]:  # (bounded: the busiest only)
                replicas.add_metric([str(k.get("dataset", "")), str(k.get("directory", ""))], k.get("replicas", 0))
            yield replicas

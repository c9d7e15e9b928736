"""A node's one scrape endpoint: the metrics every cachefs process on the node wrote to ``metrics.dir``
(prometheus-client's multiprocess files, summed) and what the node's cache holds (read from the index).
Served by ``cachefs metrics`` and ``cachefs csi-mounter --metrics-listen`` (docs/METRICS.md)."""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client import multiprocess as mp

from cachefs.base.config import Config
from cachefs.base.errors import ConfigError
from cachefs.base.metrics_files import compact_dead, directory_lock
from cachefs.status.collector import NodeCollector

__all__ = ["node_registry", "serve_metrics"]


def node_registry(config: Config) -> CollectorRegistry:
    """A registry of the node's processes (their multiprocess files, when PROMETHEUS_MULTIPROC_DIR is set; else
    this process's own metrics) and of its cache."""
    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if d and os.path.isdir(d):
        registry = CollectorRegistry()
        registry.register(_CompactingCollector(d))
    else:
        registry = REGISTRY
    registry.register(NodeCollector(config))
    return registry


def serve_metrics(config: Config, host: str, port: int):
    """Serve ``/metrics`` on ``host:port`` from a thread of its own; returns (server, thread). ConfigError naming the
    address when it cannot listen there (in use, not an address of this host)."""
    try:
        return start_http_server(port, addr=host, registry=node_registry(config))
    except OSError as exc:
        raise ConfigError(f"metrics endpoint {host}:{port}: {exc.strerror or exc}") from None


class _CompactingCollector(mp.MultiProcessCollector):
    """The processes' files, summed, after folding those of dead processes into the archive (under the directory's
    lock, so that no scrape sees a dead process's values twice or not at all)."""

    def __init__(self, path: str) -> None:
        super().__init__(None, path=path)
        self.path = path

    def collect(self):
        with directory_lock(self.path):
            compact_dead(self.path)
            return list(super().collect())

"""A node's one scrape endpoint: the metrics every cachefs process on the node wrote to ``metrics.dir``
(prometheus-client's multiprocess files, summed) and what the node's cache holds (read from the index).
Served by ``cachefs metrics`` and ``cachefs csi-mounter --metrics-listen`` (docs/METRICS.md)."""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client import multiprocess as mp

from cachefs.base.config import Config
from cachefs.base.errors import ConfigError
from cachefs.status.collector import NodeCollector

__all__ = ["node_registry", "serve_metrics"]


def node_registry(config: Config) -> CollectorRegistry:
    """A registry of the node's processes (their multiprocess files, when PROMETHEUS_MULTIPROC_DIR is set; else
    this process's own metrics) and of its cache."""
    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if d and os.path.isdir(d):
        registry = CollectorRegistry()
        mp.MultiProcessCollector(registry, path=d)
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

"""Prometheus metrics of the scheduler extender (docs/METRICS.md). The extender is one process: its metrics are
served from its own registry (``cachefs scheduler-extender --metrics-listen``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

__all__ = ["BINDINGS", "GANG_ADMISSIONS", "GANG_WAITS", "REQUESTS", "REQUEST_SECONDS"]

REQUESTS = Counter("cachefs_extender_requests", "Extender requests answered, by verb and HTTP status",
                   ["verb", "code"])
#: From sub-millisecond answers on a small cluster to kube-scheduler's 5 s extender timeout.
REQUEST_SECONDS = Histogram("cachefs_extender_request_duration_seconds", "Time to answer an extender request",
                            ["verb"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                               30.0))
GANG_ADMISSIONS = Counter("cachefs_extender_gang_admissions", "Gangs admitted (all their GPUs fit) or refused for "
                          "now", ["result"])
GANG_WAITS = Counter("cachefs_extender_gang_waits", "Binds that waited for their gang: complete (the gang was "
                     "placed) or timeout (released)", ["result"])
BINDINGS = Counter("cachefs_extender_bindings", "Pods the extender bound, by result", ["result"])

"""Prometheus metrics of cachefs's own processes: every name in one place (docs/METRICS.md lists them; a test
keeps the two in step).

A node runs many cachefs processes (FUSE holders and daemons, the CSI plugin and its mounter); their counters
reach one scrape endpoint through prometheus-client's multiprocess mode: each process writes its values to
memory-mapped files in ``PROMETHEUS_MULTIPROC_DIR`` (set from ``metrics.dir`` by the ``cachefs`` command before
this module is imported), and the endpoint (:mod:`cachefs.status.server`) sums them. What the whole node holds
(bytes cached, per-dataset hits and misses, evictions) is read from the index at scrape time instead
(:mod:`cachefs.status.collector`), the same figures ``cachefs status`` prints.

Counters on hot paths are kept as plain integers where they arise and added here in batches (every statistics
flush, about once a second), so that a warm read pays for no metric update.
"""

from __future__ import annotations

import atexit
import bisect
import functools
import logging
import os
import threading
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, values

from cachefs.base.errors import (
    AccessDeniedError,
    CacheFSError,
    CredentialsError,
    ObjectNotFoundError,
    OriginUnavailableError,
    StaleObjectError,
    ThrottledError,
    TransientOriginError,
    TruncatedBodyError,
)

__all__ = ["BatchedHistogram", "Deltas", "multiprocess", "result_of", "safely"]


def multiprocess() -> bool:
    """Whether this process writes its metrics for a node-wide endpoint (PROMETHEUS_MULTIPROC_DIR is set)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def _name_files_by_process_and_namespace() -> None:
    """Before any metric exists: this process's files are named by pid and pid namespace, and a lock says it is
    alive (:mod:`cachefs.base.metrics_files`)."""
    from cachefs.base.metrics_files import hold_live_lock, live_identity, process_identity

    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    try:
        hold_live_lock(directory, process_identity())
    except OSError as exc:  # a metric must never stop the process: keep them to ourselves
        logging.getLogger(__name__).info("metrics stay in this process: %s: %s", directory, exc.strerror)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        values.ValueClass = values.MutexValue
        return
    values.ValueClass = values.MultiProcessValue(process_identifier=live_identity)


if multiprocess():
    _name_files_by_process_and_namespace()

#: Latency buckets of origin requests: a local S3 answers in a millisecond, a cross-region one in a second.
_ORIGIN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Latency buckets of FUSE requests: page-cache answers take microseconds, a cold read the origin's time.
FUSE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5, 10.0)

# -- the read path ---------------------------------------------------------------------------------------------
READ_BYTES = Counter("cachefs_read_bytes", "Bytes served to readers (mount, cachefs::), by file kind and whether they "
                     "were on this node before the read asked (hit) or fetched for it (miss)", ["kind", "result"])
TIER_BYTES = Counter("cachefs_tier_bytes", "Bytes served to the read paths, by where they came from", ["tier"])
CORRUPT_READS = Counter("cachefs_corrupt_reads", "Cached blocks or small files that failed their checksum on this "
                        "node's disk (dropped and fetched again), by file kind", ["kind"])
TIER_FALLBACKS = Counter("cachefs_tier_fallbacks", "Times a tier could not serve and the next one was asked, by "
                         "tier and reason", ["tier", "reason"])
ORIGIN_REQUESTS = Counter("cachefs_origin_requests", "Requests to the origin (each attempt), by kind and result",
                          ["kind", "result"])
ORIGIN_SECONDS = Histogram("cachefs_origin_request_duration_seconds", "Time of origin requests (each attempt)",
                           ["kind"], buckets=_ORIGIN_BUCKETS)
ORIGIN_RETRIES = Counter("cachefs_origin_retries", "Origin requests tried again, by the reason", ["reason"])
MEMORY_RESERVED = Gauge("cachefs_memory_reserved_bytes", "Memory held for fetches in flight (all live processes)",
                        multiprocess_mode="livesum")
MEMORY_BUDGET = Gauge("cachefs_memory_budget_bytes", "The memory budgets of the live processes, summed",
                      multiprocess_mode="livesum")
ORDER_AHEAD_FILES = Gauge("cachefs_order_ahead_files", "Files fetched (or being fetched) ahead of their readers in "
                          "published read orders (all live processes)", multiprocess_mode="livesum")
ORDER_AHEAD_BYTES = Gauge("cachefs_order_ahead_bytes", "Their bytes (all live processes)", multiprocess_mode="livesum")
ORDER_AHEAD_SECONDS = Gauge("cachefs_order_ahead_seconds", "How many seconds of reading the furthest-ahead order's "
                            "lookahead holds, at its reader's pace", multiprocess_mode="livemax")
DISK_REFUSED = Counter("cachefs_disk_writes_refused", "Writes of cached bytes refused for want of room (served "
                       "without caching)")

# -- FUSE ------------------------------------------------------------------------------------------------------
FUSE_REQUESTS = Counter("cachefs_fuse_requests", "FUSE requests answered, by opcode and whether with an error",
                        ["op", "result"])
FUSE_SECONDS = Histogram("cachefs_fuse_request_duration_seconds", "Time from reading a FUSE request to answering it",
                         ["op"], buckets=FUSE_BUCKETS)
FUSE_OPENS = Counter("cachefs_fuse_opens", "Files opened through mounts, by how their reads are served "
                     "(passthrough: by the kernel from the cache file; userspace: through the daemon)", ["mode"])
FUSE_USERSPACE_BYTES = Counter("cachefs_fuse_userspace_read_bytes", "Bytes read through mounts by the daemon "
                               "(passthrough reads never reach it)")
FUSE_RESTARTS = Counter("cachefs_fuse_daemon_restarts", "FUSE daemons a mount's holder started again after one died")
FUSE_FAILING = Gauge("cachefs_fuse_mounts_failing", "Mounts whose holder answers requests itself because no daemon "
                     "can start", multiprocess_mode="livesum")

# -- the peer server -------------------------------------------------------------------------------------------
PEER_REQUESTS = Counter("cachefs_peer_requests", "Requests the peer server answered, by route and status class "
                        "(2xx, 4xx, 5xx)", ["route", "status"])
PEER_ERRORS = Counter("cachefs_peer_errors", "Requests to other members of the cache group that failed, by reason "
                      "(unreachable, http, bad_answer, corrupt); the read went to the next holder or tier", ["reason"])
PEER_REFUSED_CONNECTIONS = Counter("cachefs_peer_refused_connections", "Connections to the peer server closed at "
                                   "once: their client already held as many as one client may")

# -- CSI -------------------------------------------------------------------------------------------------------
CHECKPOINT_STAGED_BYTES = Gauge("cachefs_checkpoint_staged_bytes", "Bytes written to writable volumes and not yet on "
                                "the origin (all live processes)", multiprocess_mode="livesum")
CHECKPOINT_STAGED_FILES = Gauge("cachefs_checkpoint_staged_files", "Closed files waiting for their upload",
                                multiprocess_mode="livesum")
CHECKPOINT_BELOW_PROMISE = Gauge("cachefs_checkpoint_below_promise_bytes", "Staged bytes held by fewer copies than "
                                 "checkpoint durability promises (written but not yet closed or fsynced)",
                                 multiprocess_mode="livesum")
CHECKPOINT_OLDEST_SECONDS = Gauge("cachefs_checkpoint_oldest_staged_seconds", "Age of the oldest closed file not yet "
                                  "on the origin", multiprocess_mode="max")
CHECKPOINT_UPLOADED_BYTES = Counter("cachefs_checkpoint_uploaded_bytes", "Bytes of closed files written to the origin")
CHECKPOINT_FAILURES = Counter("cachefs_checkpoint_upload_failures", "Uploads that failed (each attempt of a queue "
                              "entry), by reason", ["reason"])
CSI_CALLS = Counter("cachefs_csi_calls", "CSI calls answered, by method and gRPC code", ["method", "code"])

# CacheDataset warm-ups on this node (the node agent; docs/DATASETS.md)
WARMUP_FILES = Gauge("cachefs_warmup_files", "Files of this node's warm-up of a dataset: wanted, done, failed",
                     ["dataset", "state"], multiprocess_mode="livesum")
WARMUP_BYTES = Gauge("cachefs_warmup_bytes", "Bytes of this node's warm-up of a dataset: wanted, done (fetched or "
                     "found cached)", ["dataset", "state"], multiprocess_mode="livesum")
WARMUP_RUNNING = Gauge("cachefs_warmup_running", "1 while this node warms the dataset up, 0 once it is done, failed "
                       "or cancelled", ["dataset"], multiprocess_mode="livesum")


_log = logging.getLogger(__name__)
_warned = False


def safely(update: Callable[[], object]) -> None:
    """Run a metric update; a failure (the metrics directory's file system full, say) is logged once and never
    reaches the request being counted."""
    global _warned
    try:
        update()
    except OSError as exc:
        if not _warned:
            _warned = True
            _log.warning("metrics not recorded: %s", exc)


def _forget_at_exit(directory: str) -> None:
    from prometheus_client import multiprocess as mp

    from cachefs.base.metrics_files import process_identity

    try:
        # Its live gauges go; its counters keep counting in the sums. (The directory as it was at start: a program
        # that embeds cachefs may have dropped the variable from its environment since.)
        mp.mark_process_dead(process_identity(), directory)
    except OSError:
        pass


if multiprocess():
    atexit.register(_forget_at_exit, os.environ["PROMETHEUS_MULTIPROC_DIR"])


def result_of(exc: BaseException | None) -> str:
    """The ``result`` label of an origin request that ended with ``exc`` (None: it succeeded)."""
    if exc is None:
        return "ok"
    for cls, name in ((ObjectNotFoundError, "not_found"), (CredentialsError, "credentials"),
                      (AccessDeniedError, "denied"), (StaleObjectError, "changed"), (ThrottledError, "throttled"),
                      (TruncatedBodyError, "truncated"), (OriginUnavailableError, "unreachable"),
                      (TransientOriginError, "transient"), (CacheFSError, "error")):
        if isinstance(exc, cls):
            return name
    return "error"


class Deltas:
    """Adds cumulative figures kept elsewhere (plain integers on a hot path) to counters: each :meth:`push`
    adds what grew since the last one."""

    def __init__(self) -> None:
        self._last: dict[tuple, int | float] = {}
        self._lock = threading.Lock()

    def push(self, counter, labels: tuple[str, ...], total: int | float) -> None:
        with self._lock:
            grew = total - self._last.get((counter, labels), 0)
            self._last[counter, labels] = total
        if grew > 0:
            safely(lambda: (counter.labels(*labels) if labels else counter).inc(grew))


class BatchedHistogram:
    """Observations of a labelled histogram kept locally (a few bisects, no lock: one writer thread per label
    set is not required, a lost increment under a race only undercounts) and added to it in :meth:`flush`."""

    def __init__(self, histogram: Histogram, buckets: tuple[float, ...]) -> None:
        self.histogram, self.bounds = histogram, buckets
        self._counts: dict[str, list] = {}  # label → [per-bucket counts (+inf last), sum]
        self._lock = threading.Lock()

    def observe(self, label: str, seconds: float) -> None:
        got = self._counts.get(label)
        if got is None:
            got = self._counts.setdefault(label, [[0] * (len(self.bounds) + 1), 0.0])
        got[0][bisect.bisect_left(self.bounds, seconds)] += 1
        got[1] += seconds

    def flush(self) -> None:
        with self._lock:
            taken, self._counts = self._counts, {}
        for label, (counts, total) in taken.items():
            safely(functools.partial(self._add, label, counts, total))

    def _add(self, label: str, counts: list[int], total: float) -> None:
        child = self.histogram.labels(label)
        # prometheus-client keeps one (non-cumulative) value per bucket and adds them up when collected; its
        # observe() is one increment of one of them, so n observations in a bucket are one increment of n.
        for value, n in zip(child._buckets, counts, strict=True):
            if n:
                value.inc(n)
        child._sum.inc(total)

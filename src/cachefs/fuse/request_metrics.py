"""The FUSE daemon's request metrics: counted and timed as requests are answered, kept here as plain counts and
added to the process's metrics once a second (:meth:`RequestMetrics.flush`), so that a request pays for a clock
read and a few dictionary updates, not for the metrics' file writes."""

from __future__ import annotations

import time

from cachefs.base import metrics
from cachefs.fuse.kernel_abi import Op

__all__ = ["RequestMetrics"]

_NAMES = {int(op): op.name.lower() for op in Op}


class RequestMetrics:
    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}  # (op, ok/error) → answered since start
        self._times = metrics.BatchedHistogram(metrics.FUSE_SECONDS, metrics.FUSE_BUCKETS)
        self._deltas = metrics.Deltas()

    def answered(self, opcode: int, started: float | None, ok: bool = True) -> None:
        op = _NAMES.get(opcode) or f"op{opcode}"
        key = (op, "ok" if ok else "error")
        self._counts[key] = self._counts.get(key, 0) + 1
        if started is not None:
            self._times.observe(op, time.perf_counter() - started)

    def flush(self, fs_stats: dict) -> None:
        """Add what was answered since the last flush, and the file system's counters (``CacheFS.stats``)."""
        push = self._deltas.push
        for (op, result), n in list(self._counts.items()):
            push(metrics.FUSE_REQUESTS, (op, result), n)
        self._times.flush()
        push(metrics.FUSE_OPENS, ("passthrough",), fs_stats.get("passthrough_opens", 0))
        push(metrics.FUSE_OPENS, ("userspace",), fs_stats.get("userspace_opens", 0))
        push(metrics.FUSE_USERSPACE_BYTES, (), fs_stats.get("userspace_read_bytes", 0))

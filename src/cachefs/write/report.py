"""What ``cachefs status`` and the metrics show about a writable volume."""

from __future__ import annotations

import os
import time
from typing import Any

from cachefs.base.metrics import (
    CHECKPOINT_BELOW_PROMISE,
    CHECKPOINT_OLDEST_SECONDS,
    CHECKPOINT_STAGED_BYTES,
    CHECKPOINT_STAGED_FILES,
    safely,
)
from cachefs.index.volumes import queue_figures
from cachefs.write.queue import EntryKind, UploadQueue
from cachefs.write.uploader import Uploader

__all__ = ["durability", "export_metrics", "volume_status"]


def volume_status(queue: UploadQueue, uploader: Uploader, *, dirty: int, wanted: int, staging_limit: int,
                  writers_waiting: int, **ident: Any) -> dict[str, Any]:
    """Staged bytes and files (``dirty``: written to open files, not queued yet), the durability reached
    (``wanted``: copies other members must hold), the upload's rate, lag and failures, what is pending; ``ident``
    (url, dir, writer) goes in as given."""
    with queue.lock:
        entries = list(queue.entries)
        failed = dict(queue.failed)
        last = queue.next_seq - 1
    puts = [e for e in entries if e.kind is EntryKind.PUT]
    queued = sum(e.size for e in puts)
    rate = uploader.rate
    return {
        **ident, "pid": os.getpid(), "time": time.time(),
        "durability": durability(wanted),
        **queue_figures([(e.kind, e.key, e.size, e.added) for e in entries], dirty),
        "below_promise_bytes": dirty + sum(e.size for e in puts if len(e.held_by) < wanted),
        "staging_limit": staging_limit, "writers_waiting": writers_waiting,
        "uploaded_bytes": queue.uploaded_bytes, "upload_rate": rate,
        "upload_lag": queued / rate if rate > 0 else (0.0 if not queued else None),
        "failures": uploader.failures, "last_error": uploader.last_error,
        "failed": {str(k): e for k, e in failed.items()},
        "last_seq": last, "done_through": (min(e.seq for e in entries) - 1) if entries else last,
    }


def durability(wanted: int) -> str:
    """The promise a ``close`` keeps, with ``wanted`` other members holding copies."""
    if wanted:
        return (f"replicated: each closed file fsynced here and held by {wanted} other member(s) of the cache "
                "group until its upload")
    return "local: each closed file fsynced on this node's disk (no other copy until its upload)"


def export_metrics(st: dict[str, Any]) -> None:
    """The metrics of a volume's status (:func:`volume_status`)."""
    def update() -> None:
        CHECKPOINT_STAGED_BYTES.set(st["staged_bytes"])
        CHECKPOINT_STAGED_FILES.set(st["staged_files"])
        CHECKPOINT_BELOW_PROMISE.set(st["below_promise_bytes"])
        CHECKPOINT_OLDEST_SECONDS.set(st["oldest_staged_age"])

    safely(update)

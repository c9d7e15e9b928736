"""Listings of the origin under way on this node (a dataset's first manifest, a refresh): small JSON files under
``<cache dir>/listings/``, one per dataset, written about once a second by the process listing, read by ``cachefs
status`` and the node's metrics. A record of a process that is gone is ignored (its listing was interrupted)."""

from __future__ import annotations

import contextlib
import json
import os
import time

from cachefs.index.mounts import process_alive, write_record

__all__ = ["ListingProgress", "listings_under_way"]


def _dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "listings")


class ListingProgress:
    """What one listing has found so far, recorded at most every ``every`` seconds (and at :meth:`note`'s first
    call), gone once the listing ends (:meth:`done`)."""

    def __init__(self, cache_dir: str, ds_id: str, url: str, every: float = 1.0) -> None:
        self.path = os.path.join(_dir(cache_dir), ds_id + ".json")
        self.url, self.every = url, every
        self.started = time.time()
        self._written = 0.0

    def note(self, files: int, nbytes: int) -> None:
        now = time.monotonic()
        if now - self._written < self.every:
            return
        self._written = now
        write_record(self.path, {"url": self.url, "pid": os.getpid(), "started": self.started, "updated": time.time(),
                                 "files": files, "bytes": nbytes})  # (a full cache disk skips it: the listing goes on)

    def done(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def listings_under_way(cache_dir: str) -> list[dict]:
    """The listings running now: url, started, files and bytes found so far, and their rate (files/s)."""
    try:
        names = sorted(os.listdir(_dir(cache_dir)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        try:
            with open(os.path.join(_dir(cache_dir), name)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or not process_alive(rec.get("pid")):
            continue
        elapsed = max(1e-3, rec["updated"] - rec["started"])
        out.append({"url": rec["url"], "started": rec["started"], "files": rec["files"], "bytes": rec["bytes"],
                    "files_per_second": round(rec["files"] / elapsed)})
    return out

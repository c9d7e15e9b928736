"""Listings of the origin under way on this node (a dataset's first manifest, a refresh): small JSON files under
``<cache dir>/listings/``, one per dataset, written about once a second by the process listing, read by ``cachefs
status`` and the node's metrics. A record of a process that is gone is not shown (its listing was interrupted); it
names the manifest version being written and the parts of the origin listed whole, from which the next listing of
that dataset resumes (:func:`interrupted_listing`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

from cachefs.index.mounts import process_alive, write_record

__all__ = ["ListingProgress", "interrupted_listing", "listings_under_way"]


def _dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "listings")


class ListingProgress:
    """What one listing of manifest ``version`` has found so far, and the units (parts of the origin's tree) it
    listed whole: recorded at most every ``every`` seconds (and at :meth:`note`'s first call), gone once the
    listing ends (:meth:`done`)."""

    def __init__(self, cache_dir: str, ds_id: str, url: str, version: int = 0, every: float = 1.0) -> None:
        self.path = os.path.join(_dir(cache_dir), ds_id + ".json")
        self.url, self.version, self.every = url, version, every
        self.started = time.time()
        self._written = 0.0
        self._found = (0, 0)
        self.units_done: set[str] = set()

    def note(self, files: int, nbytes: int) -> None:
        self._found = (files, nbytes)
        if time.monotonic() - self._written >= self.every:
            self._write()

    async def keep_written(self) -> None:
        """Write the record every ``every`` seconds while it runs (a listing waiting on the origin notes nothing)."""
        while True:
            await asyncio.sleep(self.every)
            if time.monotonic() - self._written >= self.every:
                self._write()

    def _write(self) -> None:
        self._written = time.monotonic()
        files, nbytes = self._found
        write_record(self.path, {"url": self.url, "pid": os.getpid(), "started": self.started, "updated": time.time(),
                                 "files": files, "bytes": nbytes, "version": self.version,
                                 "units_done": sorted(self.units_done)})  # (a full disk skips it: the listing goes on)

    def done(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def interrupted_listing(cache_dir: str, ds_id: str, version: int) -> set[str] | None:
    """The units an interrupted listing of ``ds_id``'s manifest ``version`` had listed whole (its process is gone
    and left its record), or None if none was."""
    try:
        with open(os.path.join(_dir(cache_dir), ds_id + ".json")) as f:
            rec = json.load(f)
        if rec.get("version") != version or process_alive(rec.get("pid")):
            return None
        return {str(u) for u in rec["units_done"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


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

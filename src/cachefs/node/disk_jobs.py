"""Blocking disk work (block and pack writes, eviction) on threads of its own, so that the event loop never
waits on the disk, and so that shutdown can wait for every write still running before files are closed (a
task awaiting a write can be cancelled; the write itself cannot)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

__all__ = ["DiskJobs"]

T = TypeVar("T")


class DiskJobs:
    def __init__(self, threads: int = 8) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="cachefs-disk")
        self._jobs: set[concurrent.futures.Future] = set()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a disk thread (here, at interpreter exit, when no thread may start)."""
        try:
            job = self._pool.submit(fn, *args)
        except RuntimeError:
            return fn(*args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return await asyncio.wrap_future(job)

    def wait(self) -> None:
        """Block until every job submitted so far has finished."""
        concurrent.futures.wait(list(self._jobs))

    async def drain(self) -> None:
        """:meth:`wait` from the event loop (through the jobs' futures: no thread needed)."""
        await asyncio.gather(*(asyncio.wrap_future(j) for j in list(self._jobs)), return_exceptions=True)

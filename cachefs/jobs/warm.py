"""Dataset warm-up: fetch every selected file of a dataset into the node cache.

Resumable by construction: blocks already present are skipped (the index is the checkpoint), and an
interrupted run leaves only whole, verified blocks behind. Files are taken in manifest order (directory by
directory, names sorted) by a pool of workers, so a reader walking the tree in the same order finds
the files it wants early; every block goes through the engine, which enforces the memory budget and
fetch concurrency.
"""

from __future__ import annotations

import asyncio
import fnmatch
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from cachefs.base.errors import CacheFSError, CacheFullError, CredentialsError, OriginUnavailableError
from cachefs.base.types import Entry
from cachefs.engine import Engine
from cachefs.manifest.dataset import Dataset

__all__ = ["Progress", "select_files", "warm"]


@dataclass
class Progress:
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    #: Bytes that were already cached when the run started (resume) and needed no fetch.
    bytes_skipped: int = 0
    bytes_fetched: int = 0
    started: float = field(default_factory=time.monotonic)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def rate(self) -> float:
        """Fetched bytes per second."""
        return self.bytes_fetched / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the rate so far; None until there is a rate worth extrapolating (two seconds and
        some bytes in: the first GETs' latency alone would give hours)."""
        left = self.bytes_total - self.bytes_done
        if left <= 0:
            return 0.0
        if self.elapsed < 2.0 or self.bytes_fetched == 0:
            return None
        return left / self.rate


def select_files(files: Iterable[Entry], include: list[str] | None = None, exclude: list[str] | None = None
                 ) -> Iterator[Entry]:
    """Files whose dataset-relative path matches any ``include`` glob (all when none) and no ``exclude``."""
    for e in files:
        if include and not any(fnmatch.fnmatchcase(e.path, g) for g in include):
            continue
        if exclude and any(fnmatch.fnmatchcase(e.path, g) for g in exclude):
            continue
        yield e


async def warm(
    engine: Engine,
    ds: Dataset,
    *,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    workers: int = 64,
    on_progress: Callable[[Progress], None] | None = None,
) -> Progress:
    """Cache every selected file of ``ds``. Files that fail are listed in ``Progress.failed``; a full disk,
    missing credentials or an unreachable origin stop the whole run (raised)."""
    files = list(select_files(ds.walk_files(), include, exclude))
    prog = Progress(files_total=len(files), bytes_total=sum(e.size for e in files))
    todo: list[tuple[Entry, int]] = []  # with the bytes it had when the run started
    for e in files:
        have = engine.cached_bytes(ds, e)
        if have >= e.size:
            prog.files_done += 1
            prog.bytes_done += e.size
            prog.bytes_skipped += e.size
        else:
            prog.bytes_done += have
            prog.bytes_skipped += have
            todo.append((e, have))
    if on_progress:
        on_progress(prog)
    it = iter(todo)

    async def worker() -> None:
        for e, have in it:
            left = [e.size - have]  # bytes of this file not counted yet (its blocks are counted as they land)

            def on_bytes(n: int, left: list[int] = left) -> None:
                n = min(n, left[0])
                left[0] -= n
                prog.bytes_fetched += n
                prog.bytes_done += n
                if on_progress:
                    on_progress(prog)

            try:
                await engine.ensure_cached(ds, e, on_bytes)
            except (CacheFullError, CredentialsError, OriginUnavailableError):
                raise
            except CacheFSError as exc:
                prog.failed.append((e.path, str(exc)))
                landed = e.size - have - left[0]  # (its blocks stay cached; the next run counts them as skipped)
                prog.bytes_fetched -= landed
                prog.bytes_done -= landed
                continue
            # Counted per file from the start of the run: a file that came in with another one (a window of a
            # packed mirror holds hundreds) was fetched by this run all the same.
            rest = left[0]
            prog.bytes_fetched += rest
            prog.bytes_done += rest
            prog.files_done += 1
            if on_progress:
                on_progress(prog)

    # What this run brings in is not evicted to make room for the rest of it: a selection larger than the cache
    # fails as a full disk, instead of "succeeding" with most of it evicted again.
    kept_before, engine.prefetching_since = engine.prefetching_since, time.time() - 1.0
    tasks = [asyncio.ensure_future(worker()) for _ in range(max(1, min(workers, len(todo))))]
    try:
        await asyncio.gather(*tasks)
        await engine.persist()  # small files wait in memory for their pack: on disk before we say "done"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        engine.prefetching_since = kept_before
        engine.flush_stats()
    if on_progress:
        on_progress(prog)
    return prog

"""Dataset warm-up: fetch every selected file of a dataset into the node cache.

Resumable by construction: blocks already present are skipped (the index is the checkpoint), and an
interrupted run leaves only whole, verified blocks behind. Files are taken in manifest order (directory by
directory, names sorted) as a job of the prefetcher (:meth:`~cachefs.prefetch.prefetcher.Prefetcher.run_job`), so a
reader walking the tree in the same order finds the files it wants early; every block goes through the engine,
which enforces the memory budget and fetch concurrency.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from cachefs.base.errors import CacheFSError, CacheFullError, CredentialsError, OriginUnavailableError
from cachefs.base.types import Entry
from cachefs.engine import Engine
from cachefs.manifest.dataset import Dataset
from cachefs.node.budget import Reservation
from cachefs.prefetch.prefetcher import Hint

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
    only: Callable[[Entry], bool] | None = None,
) -> Progress:
    """Cache every selected file of ``ds`` (``only``: of those, the ones it accepts, e.g. this member's share of a
    cache group's). Files that fail are listed in ``Progress.failed``; a full disk, missing credentials or an
    unreachable origin stop the whole run (raised)."""
    files = [e for e in select_files(ds.walk_files(), include, exclude) if only is None or only(e)]
    prog = Progress(files_total=len(files), bytes_total=sum(e.size for e in files))
    wanted: dict[str, int] = {}  # per file to fetch: its bytes missing when the run started
    left: dict[str, int] = {}  # and those of them not counted yet (blocks are counted as they land)
    for e in files:
        have = engine.cached_bytes(ds, e)
        if have >= e.size:
            prog.files_done += 1
            prog.bytes_done += e.size
            prog.bytes_skipped += e.size
        else:
            prog.bytes_done += have
            prog.bytes_skipped += have
            wanted[e.path] = left[e.path] = e.size - have
    if on_progress:
        on_progress(prog)

    def on_bytes(path: str, n: int) -> None:
        n = min(n, left[path])
        left[path] -= n
        prog.bytes_fetched += n
        prog.bytes_done += n
        if on_progress:
            on_progress(prog)

    async def fetch(e: Entry, _held: Reservation | None) -> None:
        await engine.ensure_cached(ds, e, functools.partial(on_bytes, e.path))

    def hint(e: Entry) -> Hint:
        return Hint(e.path, 0, "job", functools.partial(fetch, e))

    def settle(path: str, exc: BaseException | None) -> None:
        if isinstance(exc, CacheFullError | CredentialsError | OriginUnavailableError):
            raise exc
        if isinstance(exc, CacheFSError):
            prog.failed.append((path, str(exc)))
            landed = wanted[path] - left[path]  # (its blocks stay cached; the next run counts them as skipped)
            prog.bytes_fetched -= landed
            prog.bytes_done -= landed
            return
        if exc is not None:
            raise exc
        # Counted per file from the start of the run: a file that came in with another one (a window of a packed
        # mirror holds hundreds) was fetched by this run all the same.
        on_bytes(path, left[path])
        prog.files_done += 1
        if on_progress:
            on_progress(prog)

    # What this run brings in is not evicted to make room for the rest of it (by any process on the node): a
    # selection larger than the cache fails as a full disk, instead of "succeeding" with most of it evicted again.
    async with engine.eviction.keeping_newer_than(time.time() - 1.0):
        try:
            todo = (hint(e) for e in files if e.path in left)
            async with contextlib.aclosing(engine.prefetcher.run_job(todo, concurrency=workers)) as jobs:
                async for done, exc in jobs:
                    settle(str(done.key), exc)
            await engine.persist()  # small files wait in memory for their pack: on disk before we say "done"
        finally:
            engine.flush_stats()
    if on_progress:
        on_progress(prog)
    return prog

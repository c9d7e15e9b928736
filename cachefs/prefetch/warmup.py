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

from ..engine import Dataset, Engine
from ..errors import CacheFSError, CacheFullError, CredentialsError, OriginUnavailableError
from ..types import Entry

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
        left = self.bytes_total - self.bytes_done
        return left / self.rate if self.rate > 0 else None


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
            try:
                await engine.ensure_cached(ds, e)
            except (CacheFullError, CredentialsError, OriginUnavailableError):
                raise
            except CacheFSError as exc:
                prog.failed.append((e.path, str(exc)))
                continue
            # Counted per file from the start of the run: a file that came in with another one (a window of a
            # packed mirror holds hundreds) was fetched by this run all the same.
            prog.bytes_fetched += e.size - have
            prog.bytes_done += e.size - have
            prog.files_done += 1
            if on_progress:
                on_progress(prog)

    tasks = [asyncio.ensure_future(worker()) for _ in range(max(1, min(workers, len(todo))))]
    try:
        await asyncio.gather(*tasks)
        await engine.persist()  # small files wait in memory for their pack: on disk before we say "done"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        engine.flush_stats()
    if on_progress:
        on_progress(prog)
    return prog

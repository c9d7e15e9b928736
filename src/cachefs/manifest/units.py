"""A listing of the origin that a restart resumes: the tree is listed in units, each written to the manifest version
under way as it comes and recorded once it is whole, so that the next listing after a kill lists only the rest.

Units are the tree's directories: the top ones, split a level further (one LIST of each, with ``/`` as the
delimiter) while there are fewer than :data:`UNITS`, at most :data:`MAX_DEPTH` levels down; the files beside them
are written as those LISTs bring them, and a directory so listed that has no subdirectory is a unit done. The rest
are then listed whole (:meth:`~cachefs.sources.Source.list_tree`, which the source parallelises itself), up to
``origin.list_concurrency`` units at a time. A resumed listing splits the tree again (the same LISTs, but none of
a unit done). Sources that cannot list
one directory (``lists_directories`` false) are listed in one piece, and an interrupted listing of them starts over.
"""

from __future__ import annotations

import asyncio

from cachefs.base.types import Entry
from cachefs.index.listings import ListingProgress
from cachefs.manifest.store import ManifestWriter
from cachefs.sources import Source

__all__ = ["MAX_DEPTH", "UNITS", "list_in_units"]

#: Split the tree until it has at least this many units (a resumed listing loses at most the units under way).
UNITS = 64
#: ... but never deeper than this many levels below the dataset's root.
MAX_DEPTH = 3


async def list_in_units(source: Source, url: str, writer: ManifestWriter, progress: ListingProgress,
                        concurrency: int) -> None:
    """List ``url`` into ``writer``, skipping the units ``progress`` says are done and recording those it finishes."""
    if not source.lists_directories:
        async for batch in source.list_tree(url):
            _write(writer, progress, batch)
        return
    units = await _units(source, url, writer, progress, concurrency)
    sem = asyncio.Semaphore(concurrency)

    async def list_unit(unit: str) -> None:
        async with sem:
            base = unit + "/"
            async for batch in source.list_tree(f"{url}/{unit}"):
                _write(writer, progress, [Entry(base + e.path, e.size, e.version, e.mtime, e.is_dir) for e in batch])
        progress.units_done.add(unit)

    await _all(list_unit(u) for u in units if u not in progress.units_done)


async def _units(source: Source, url: str, writer: ManifestWriter, progress: ListingProgress,
                 concurrency: int) -> list[str]:
    """The units to list whole, writing the files found on the way down."""
    level = [""]
    sem = asyncio.Semaphore(concurrency)

    async def split(path: str) -> list[str]:
        if path in progress.units_done:
            return []
        dirs: list[str] = []
        files_seen = False
        async with sem:
            async for files, more in source.list_directory(url, path):
                if files:
                    _write(writer, progress, files)  # (page by page: a directory of millions costs one page)
                    files_seen = True
                dirs += more
        if path and not files_seen and not dirs:  # nothing under it but its marker ("dir/"): a directory all the same
            _write(writer, progress, [Entry(path + "/", 0, "", 0.0)])
        if not dirs:
            progress.units_done.add(path)  # (listed whole)
        return [f"{path}/{d}" if path else d for d in dirs]

    for _ in range(MAX_DEPTH):
        below = [d for subdirs in await _all(split(p) for p in level) for d in subdirs]
        if not below or len(below) >= UNITS:
            return below
        level = below  # (split again: their files are written, their subdirectories are the next level)
    return level


def _write(writer: ManifestWriter, progress: ListingProgress, batch: list[Entry]) -> None:
    writer.add(batch)
    progress.note(writer.files, writer.bytes)


async def _all(coros) -> list:
    """Run ``coros`` together; the first failure cancels the rest (a listing that fails stops at once)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

"""A dataset's tree while its first manifest is still being taken: a mount answers at once, at any size.

Each directory is listed from the origin the first time a reader asks for it (one listing of that directory, every
page of it), written into the index under a *provisional* manifest version of this process, and answered from
there from then on; a path looked up in a directory not listed yet costs a HEAD (a file) or the listing of its
directory (a subdirectory, or a name that is not there). Meanwhile the full manifest is taken in the background as
always; once it is committed the dataset reads it instead (:mod:`cachefs.manifest.first`) and the provisional
entries are dropped. docs/SEMANTICS.md says what a reader sees in between.

The origin is asked from the thread that wants the answer (a FUSE request thread), never from the event loop,
whose work must not wait on a listing: there, a directory not listed yet reads as empty (read-ahead plans with
what is known) and a path in one as not found.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
from collections.abc import Iterator

from cachefs.base.errors import BucketNotFoundError, ObjectNotFoundError, bucket_of
from cachefs.base.files import try_lock
from cachefs.base.types import DatasetRef, Entry
from cachefs.index import Index
from cachefs.manifest.store import ManifestStore, ManifestWriter, walk_files
from cachefs.sources import Source

__all__ = ["PROVISIONAL", "ProvisionalTree", "is_provisional"]

#: Provisional manifest versions are this bit plus 31 random ones: apart from committed versions (which count up
#: from 1) and from other processes' provisional trees (each holds a lock file while it lives).
PROVISIONAL = 0x8000_0000


def is_provisional(version: int) -> bool:
    return version >= PROVISIONAL


class ProvisionalTree:
    """Reads like a :class:`~cachefs.manifest.store.ManifestStore` (``lookup``, ``listdir``, ``walk_files`` of
    ``(dataset id, version, path)``), listing directories from ``source`` as they are asked for."""

    def __init__(self, index: Index, source: Source, ref: DatasetRef, loop: asyncio.AbstractEventLoop) -> None:
        self.store = ManifestStore(index)
        self.source, self.ref, self.loop = source, ref, loop
        self._locks = os.path.join(os.path.dirname(index.path), "locks")
        os.makedirs(self._locks, mode=0o700, exist_ok=True)
        taken = set(self.store.versions(ref.id))
        held = None
        while held is None:  # a number no other tree of this dataset has (processes may share a pid across namespaces)
            self.version = PROVISIONAL | secrets.randbits(31)
            # Held while this tree lives: whoever finds it free may drop the entries of a process that died.
            held = None if self.version in taken else try_lock(self._lock_path(self.version))
        self._held: int | None = held
        # (resumed: a directory whose listing failed part way is listed again from its first page, over the pages
        # it wrote)
        self._writer = ManifestWriter(index, ref.id, self.version, resumed=True)
        self._listed: set[str] = set()
        self._listing: dict[str, asyncio.Future] = {}  # directory → its listing under way
        self.lists = 0  # directories listed from the origin (the log says how many when the dataset settles)

    async def probe(self) -> None:
        """List the root: the dataset exists and is readable (credentials, bucket, a prefix with objects)."""
        await self._list_now("")
        if not any(True for _ in self.store.listdir(self.ref.id, self.version, "")):
            raise ObjectNotFoundError(f"{self.ref.url}: no objects under this prefix (is the URL right?)")

    # -- what a reader asks ---------------------------------------------------------------------------------
    def lookup(self, ds_id: str, version: int, path: str) -> Entry:
        parent = path.rpartition("/")[0]  # (the root's is itself: listed by probe)
        if parent in self._listed:
            return self.store.lookup(ds_id, version, path)
        if self._on_loop():
            raise ObjectNotFoundError(f"{path}: its directory is not listed yet")
        return self._wait(self._lookup(path))

    def listdir(self, ds_id: str, version: int, path: str) -> Iterator[Entry]:
        if not self._listed_now(ds_id, version, path):
            return iter(())
        return self.store.listdir(ds_id, version, path)

    def listdir_page(self, ds_id: str, version: int, path: str, after: str | None, limit: int) -> list[Entry]:
        if not self._listed_now(ds_id, version, path):
            return []
        return self.store.listdir_page(ds_id, version, path, after, limit)

    def _listed_now(self, ds_id: str, version: int, path: str) -> bool:
        """List directory ``path`` if it is not yet; False on the event loop, which must not wait for it."""
        if path not in self._listed:
            if self._on_loop():
                return False
            if path and not self.lookup(ds_id, version, path).is_dir:
                raise NotADirectoryError(20, f"{path}: not a directory")
            self._wait(self._list(path))
        return True

    def walk_files(self, ds_id: str, version: int, path: str = "") -> Iterator[Entry]:
        return walk_files(functools.partial(self.listdir, ds_id, version), path)

    def listed_size(self) -> tuple[int, int]:
        """(files, bytes) in the directories listed so far."""
        return self._writer.files, self._writer.bytes

    def drop(self) -> None:
        """Forget the provisional entries (the full manifest replaced them), and those of processes that died
        before their dataset settled (their lock is free: a process in any pid namespace holds its own)."""
        self.store.drop(self.ref.id, self.version)
        for version in self.store.versions(self.ref.id):
            if is_provisional(version) and version != self.version:
                dead = try_lock(self._lock_path(version))
                if dead is not None:
                    self.store.drop(self.ref.id, version)
                    _let_go(dead, self._lock_path(version))
        if self._held is not None:
            _let_go(self._held, self._lock_path(self.version))
            self._held = None

    def _lock_path(self, version: int) -> str:
        return os.path.join(self._locks, f"{self.ref.id}.{version:08x}.provisional")

    # -- asking the origin ----------------------------------------------------------------------------------
    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def _wait(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _lookup(self, path: str) -> Entry:
        parent = path.rpartition("/")[0]
        if parent not in self._listed:
            try:
                got = await self.source.stat(self.ref.object_url(path))
                return Entry(path, got.size, got.version, got.mtime)
            except ObjectNotFoundError:
                pass  # a directory, or nothing: the directory's listing says which
        await self._list(parent)
        return self.store.lookup(self.ref.id, self.version, path)

    async def _list(self, path: str) -> None:
        """List directory ``path`` once, however many ask at the same time (on the loop: no lock needed)."""
        if path in self._listed:
            return
        task = self._listing.get(path)
        if task is None:
            task = self._listing[path] = asyncio.ensure_future(self._list_now(path))
            task.add_done_callback(lambda _: self._listing.pop(path, None))
        await asyncio.shield(task)

    async def _list_now(self, path: str) -> None:
        self.lists += 1
        base = path + "/" if path else ""
        # Each page written as it comes (a directory of millions costs one page of memory); subdirectories as
        # directory markers (the writer makes them directories), the directory itself too.
        batch = [Entry(path + "/", 0, "", 0.0)] if path else []
        try:
            async for files, dirs in self.source.list_directory(self.ref.url, path):
                batch += files
                batch += (Entry(base + d + "/", 0, "", 0.0) for d in dirs if d)
                self._writer.add(batch)
                batch = []
        except BucketNotFoundError:
            raise BucketNotFoundError(f"{self.ref.url}: bucket {bucket_of(self.ref.url)} not found: it does not "
                                      "exist at the origin") from None
        if batch:
            self._writer.add(batch)
        self._listed.add(path)




def _let_go(fd: int, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)

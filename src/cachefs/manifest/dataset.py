"""A dataset opened at one manifest version: what every read path is handed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from cachefs.base.types import DatasetRef, Entry
from cachefs.index import DatasetRecord
from cachefs.manifest.lazy import ProvisionalTree, is_provisional
from cachefs.sources import Source

__all__ = ["Dataset", "ManifestReader"]


class ManifestReader(Protocol):
    """A dataset's tree at one version: the committed manifests (ManifestStore), or a provisional tree listed as
    it is read (ProvisionalTree)."""

    def lookup(self, ds_id: str, version: int, path: str) -> Entry: ...

    def listdir(self, ds_id: str, version: int, path: str) -> Iterator[Entry]: ...

    def listdir_page(self, ds_id: str, version: int, path: str, after: str | None, limit: int) -> list[Entry]: ...

    def walk_files(self, ds_id: str, version: int, path: str = "") -> Iterator[Entry]: ...


@dataclass
class Dataset:
    """A dataset opened at one manifest version. Metadata calls never reach the origin."""

    ref: DatasetRef
    version: int
    source: Source
    manifests: ManifestReader
    record: DatasetRecord
    #: Set once a provisional dataset settled on its first manifest (:meth:`settle`).
    settled: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)

    @property
    def provisional(self) -> bool:
        """Whether the first manifest is still being taken (directories are listed as they are read)."""
        return is_provisional(self.version)

    def size(self) -> tuple[int, int]:
        """(files, bytes) of the dataset at this version; while it is provisional, of what is listed so far."""
        if isinstance(self.manifests, ProvisionalTree):
            return self.manifests.listed_size()
        info = self.record.manifest(self.version)
        return (info.files, info.bytes) if info else (0, 0)

    def settle(self, record: DatasetRecord, manifests: ManifestReader) -> None:
        """The first manifest is committed: read it from now on (readers holding entries keep them: the bytes
        of an entry are keyed by its version)."""
        self.manifests, self.record, self.version = manifests, record, record.current
        self.settled.set()

    def stat(self, path: str) -> Entry:
        return self.manifests.lookup(self.ref.id, self.version, _norm(path))

    def listdir(self, path: str = "") -> list[Entry]:
        return list(self.manifests.listdir(self.ref.id, self.version, _norm(path)))

    def listdir_page(self, path: str, after: str | None, limit: int) -> list[Entry]:
        """At most ``limit`` entries of directory ``path`` whose names sort after ``after`` (None: from the first)."""
        return self.manifests.listdir_page(self.ref.id, self.version, _norm(path), after, limit)

    def walk_files(self, path: str = "") -> Iterator[Entry]:
        return self.manifests.walk_files(self.ref.id, self.version, _norm(path))

    def file(self, path: str) -> Entry:
        entry = self.stat(path)
        if entry.is_dir:
            raise IsADirectoryError(21, f"{path}: is a directory")
        return entry

    def object_url(self, entry: Entry) -> str:
        return self.ref.object_url(entry.path)


def _norm(path: str) -> str:
    return path.strip("/")

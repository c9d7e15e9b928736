"""A dataset opened at one manifest version: what every read path is handed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from cachefs.base.types import DatasetRef, Entry
from cachefs.index import DatasetRecord
from cachefs.manifest import ManifestStore
from cachefs.sources import Source

__all__ = ["Dataset"]


@dataclass
class Dataset:
    """A dataset opened at one manifest version. Metadata calls never reach the origin."""

    ref: DatasetRef
    version: int
    source: Source
    manifests: ManifestStore
    record: DatasetRecord

    def stat(self, path: str) -> Entry:
        return self.manifests.lookup(self.ref.id, self.version, _norm(path))

    def listdir(self, path: str = "") -> list[Entry]:
        return list(self.manifests.listdir(self.ref.id, self.version, _norm(path)))

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

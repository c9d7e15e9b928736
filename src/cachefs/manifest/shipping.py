"""A manifest as bytes, to hand to another node of the group instead of it listing the bucket again.

The bytes are msgpack: ``[format, dataset URL, [[path, size, version, mtime], ...]]`` of the files of one manifest
version. The receiver stores them as its own snapshot through the same code a listing goes through
(:class:`ReceivedListing` is a :class:`~cachefs.sources.Source` that lists what it was given).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from cachefs.base.errors import CacheFSError
from cachefs.base.types import Entry
from cachefs.manifest.store import ManifestStore
from cachefs.sources import Source

__all__ = ["FORMAT", "ReceivedListing", "pack_manifest", "unpack_manifest"]

FORMAT = 1
_BATCH = 10_000


def pack_manifest(store: ManifestStore, ds_id: str, version: int, url: str) -> bytes:
    rows = [[e.path, e.size, e.version, e.mtime] for e in store.walk_files(ds_id, version, "")]
    return msgspec.msgpack.encode([FORMAT, url, rows])


def unpack_manifest(raw: bytes, url: str) -> list[Entry]:
    """The files of a shipped manifest of dataset ``url``; CacheFSError if it is not one."""
    try:
        fmt, got_url, rows = msgspec.msgpack.decode(raw, type=tuple[int, str, list[tuple[str, int, str, float]]])
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise CacheFSError(f"a manifest from a peer does not decode: {exc}") from None
    if fmt != FORMAT or got_url != url:
        raise CacheFSError(f"a manifest from a peer is of {got_url!r} in format {fmt}, not of {url!r}")
    if any(size < 0 for _p, size, _v, _m in rows):
        raise CacheFSError("a manifest from a peer has negative sizes")
    return [Entry(path, size, version, mtime) for path, size, version, mtime in rows]


class ReceivedListing(Source):
    """A listing that is already here (the paths go through the manifest writer's checks all the same)."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries

    async def list_tree(self, root_url: str) -> AsyncIterator[list[Entry]]:
        for i in range(0, len(self.entries), _BATCH):
            yield self.entries[i:i + _BATCH]

    async def stat(self, url: str) -> Entry:
        raise CacheFSError("a received listing has no objects to stat")

    async def read(self, url: str, version: str, start: int, end: int) -> bytes:
        raise CacheFSError("a received listing has no objects to read")

    async def write(self, url: str, data: bytes) -> Entry:
        raise CacheFSError("a received listing takes no writes")

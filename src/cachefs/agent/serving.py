"""What the agent serves its cache group, apart from HTTP: which datasets, which files, which bytes.

A request names a dataset by id, a file by its dataset-relative path and version (ETag), and a block by its
index. All of it is looked up in the manifests this node holds; nothing in a request is ever used as a path. A
dataset the node does not know yet is opened only if its URL (sent along) hashes to the id and this node serves it
(``cluster.serve``: by default any dataset its group reads, on a remote origin, so that the group reads each byte
from the origin once whichever node reads first; or URL prefixes; or none). The node fetches with its own origin
settings, and never a local path (``file://``) for a member.
"""

from __future__ import annotations

import asyncio
import logging

from cachefs.base.checksum import block_checksum
from cachefs.base.types import Entry, dataset_id
from cachefs.engine import Engine
from cachefs.manifest.dataset import Dataset
from cachefs.manifest.shipping import unpack_manifest

__all__ = ["GroupServing"]

log = logging.getLogger(__name__)


#: Schemes of datasets on this node's own file system: never fetched on a member's behalf.
LOCAL_SCHEMES = ("file", "local")


class GroupServing:
    """``serve``: ``cluster.serve`` ("*", "none", or URL prefixes separated by commas)."""

    def __init__(self, engine: Engine, serve: str = "*") -> None:
        self.engine = engine
        spec = serve.strip()
        self.any_remote = spec == "*"
        self.prefixes = [] if spec in ("*", "none", "") else [p.strip().rstrip("/") for p in spec.split(",") if p.strip()]
        self._open: dict[str, Dataset] = {}
        self._opening: dict[str, asyncio.Lock] = {}

    def serves(self, url: str) -> bool:
        """Whether this node fetches ``url`` for the group when it owns a key of it (datasets a reader on this node
        opened are served whatever this says)."""
        if url.split("://", 1)[0].lower() in LOCAL_SCHEMES:
            return False
        return self.any_remote or any(url == p or url.startswith(p + "/") for p in self.prefixes)

    async def dataset(self, ds_id: str, url: str = "") -> Dataset | None:
        """The dataset ``ds_id``, opened here: one this node knows, or ``url`` if it is that dataset and one
        this node serves. None otherwise."""
        ds = self._open.get(ds_id)
        if ds is not None:
            return ds
        rec = self.engine.dataset_record(ds_id)
        if rec is None or not rec.manifests:
            if not url or dataset_id(url) != ds_id or not self.serves(url):
                return None
        async with self._opening.setdefault(ds_id, asyncio.Lock()):
            ds = self._open.get(ds_id)
            if ds is None:
                ds = self._open[ds_id] = await self.engine.open_dataset(rec.url if rec else url)
        return ds

    def entry(self, ds: Dataset, path: str, version: str) -> Entry | None:
        """The file ``path`` at ``version`` in any manifest of ``ds`` this node keeps (newest first)."""
        rec = self.engine.dataset_record(ds.ref.id) or ds.record
        for m in sorted(rec.manifests, key=lambda m: -m.version):
            try:
                e = self.engine.lookup(ds.ref.id, m.version, path)
            except OSError:
                continue
            if not e.is_dir and e.version == version:
                return e
        return None

    async def evict(self, ds_id: str) -> int | None:
        """Drop what this node caches of dataset ``ds_id`` (bytes no reader holds); the bytes freed, or None if this
        node does not know it."""
        if self.engine.dataset_record(ds_id) is None:
            return None
        return await self.engine.purge(ds_id)

    async def bytes_for(self, ds: Dataset, entry: Entry, block: int | None, *,
                        fetch: bool) -> tuple[bytes, int] | None:
        """Block ``block`` of a large file, or a whole small file (``block`` None), with the checksum the index
        recorded for it: from this node's disk, or fetched first when ``fetch`` (this node owns the key).
        None when it is neither here nor this node's to fetch."""
        return await self.engine.serve(ds, entry, block, fetch=fetch)

    async def manifest(self, ds_id: str, url: str = "") -> tuple[bytes, int] | None:
        """The current manifest of ``ds_id`` packed for a peer, with its checksum (taking it first when this
        node serves ``url`` and has none)."""
        rec = self.engine.dataset_record(ds_id)
        if rec is None or not rec.manifests:
            if await self.dataset(ds_id, url) is None:
                return None
            rec = self.engine.dataset_record(ds_id)
            if rec is None or not rec.manifests:
                return None
        raw = await asyncio.to_thread(self.engine.pack_manifest, ds_id, rec.current, rec.url)
        return raw, block_checksum(raw)

    async def take_pushed(self, ds_id: str, url: str, raw: bytes) -> bool:
        """A manifest a member took (``cachefs refresh`` there): it becomes this node's current version of the
        dataset (pinned versions stay), if this node knows the dataset or serves it. False otherwise."""
        rec = self.engine.dataset_record(ds_id)
        if rec is None or not rec.manifests:
            if not url or dataset_id(url) != ds_id or not self.serves(url):
                return False
        elif url and url != rec.url:
            return False
        target = rec.url if rec is not None and rec.manifests else url
        await self.engine.adopt_manifest(target, unpack_manifest(raw, target))
        return True

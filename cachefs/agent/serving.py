"""What the agent serves its cache group, apart from HTTP: which datasets, which files, which bytes.

A request names a dataset by id, a file by its dataset-relative path and version (ETag), and a block by its
index. All of it is looked up in the manifests this node holds; nothing in a request is ever used as a path or a
URL to fetch. A dataset the node does not know yet is opened only if its URL (sent along) hashes to the id and
starts with one of the prefixes this node serves (``cluster.serve``): a peer cannot make a node fetch
arbitrary URLs, and the node fetches with its own origin settings.
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


class GroupServing:
    def __init__(self, engine: Engine, serve_prefixes: list[str]) -> None:
        self.engine = engine
        self.prefixes = [p.rstrip("/") for p in serve_prefixes if p.strip()]
        self._open: dict[str, Dataset] = {}
        self._opening: dict[str, asyncio.Lock] = {}

    def serves(self, url: str) -> bool:
        """Whether this node fetches ``url`` for the group when it owns a key of it."""
        return any(url == p or url.startswith(p + "/") for p in self.prefixes)

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
        """A manifest a member took of a dataset this node knows (``cachefs refresh`` there): it becomes this
        node's current version too (pinned versions stay). False for a dataset this node does not know."""
        rec = self.engine.dataset_record(ds_id)
        if rec is None or not rec.manifests or (url and url != rec.url):
            return False
        await self.engine.adopt_manifest(rec.url, unpack_manifest(raw, rec.url))
        return True

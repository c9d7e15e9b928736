"""A dataset's first manifest on this node: from the cache group's member that has it, or one listing of the origin
per process; for a mount, a provisional tree at once (:mod:`cachefs.manifest.lazy`) and the manifest in the
background."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from cachefs.base import aio
from cachefs.base.config import Config
from cachefs.base.types import DatasetRef, Entry
from cachefs.index import DatasetRecord, Index
from cachefs.manifest.builder import take_snapshot
from cachefs.manifest.dataset import Dataset, ManifestReader
from cachefs.manifest.lazy import ProvisionalTree
from cachefs.manifest.shipping import ReceivedListing
from cachefs.manifest.store import ManifestStore
from cachefs.sources import Source, open_origin

__all__ = ["FirstManifests", "settle_when_listed"]

log = logging.getLogger(__name__)


Shipped = Callable[[DatasetRef], Awaitable[list[Entry] | None]]


class FirstManifests:
    """Call from the event loop. ``shipped(ref)``, handed to each call: the cache group's manifest of ``ref``, or
    None."""

    def __init__(self, config: Config, index: Index, manifests: ManifestStore) -> None:
        self.config, self.index, self.manifests = config, index, manifests
        self._locks: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Future] = set()  # listings behind provisional datasets

    async def take(self, ref: DatasetRef, src: Source, shipped: Shipped, storage_options: dict[str, Any] | None = None,
                   *, apart: bool = False) -> DatasetRecord:
        """``ref``'s first manifest, taken now unless another call took it meanwhile. With ``apart``, the
        listing runs on a loop of its own (:func:`~cachefs.base.aio.run_apart`), so that the requests of a mount
        serving meanwhile do not queue behind its pages."""
        async with self._locks.setdefault(ref.id, asyncio.Lock()):  # one listing per process
            entries = await shipped(ref)  # listed once per group, not once per node
            if entries or not apart:
                return await take_snapshot(self.index, ReceivedListing(entries) if entries else src, ref,
                                           only_if_missing=True, concurrency=self.config.origin.list_concurrency)

            async def listed() -> DatasetRecord:
                own = open_origin(ref.url, self.config, storage_options)  # (a client of that loop's own)
                try:
                    return await take_snapshot(self.index, own, ref, only_if_missing=True,
                                               concurrency=self.config.origin.list_concurrency)
                finally:
                    await own.close()

            return await aio.run_apart(listed, name="cachefs-first-listing")

    async def provisional(self, ref: DatasetRef, src: Source, shipped: Shipped,
                          storage_options: dict[str, Any] | None, *, apart: bool) -> Dataset:
        """``ref`` as a provisional tree, once its root is listed; it settles on the manifest :meth:`take` gets
        in the background."""
        tree = ProvisionalTree(self.index, src, ref, asyncio.get_running_loop())
        try:
            await tree.probe()
        except BaseException:
            tree.drop()
            raise
        ds = Dataset(ref, tree.version, src, tree, DatasetRecord(ref.id, ref.url))
        listing = self.take(ref, src, shipped, storage_options, apart=apart)
        task = asyncio.ensure_future(settle_when_listed(ds, tree, listing, self.manifests))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

        def forget_if_cancelled(t: asyncio.Future) -> None:
            if t.cancelled():  # (maybe before it ran: the process stops serving the tree, and its entries go with it)
                listing.close()
                tree.drop()

        task.add_done_callback(forget_if_cancelled)
        return ds

    def background(self) -> list[asyncio.Future]:
        """The listings under way behind provisional datasets (to cancel at shutdown)."""
        return list(self._background)


#: Seconds the provisional entries stay after the dataset settled: a lookup that began before reads them still.
SETTLE_GRACE = 5.0


async def settle_when_listed(ds: Dataset, tree: ProvisionalTree, listing: Awaitable[DatasetRecord],
                             manifests: ManifestReader) -> None:
    """Wait for ``listing`` (the first manifest of ``ds``), then let ``ds`` read it and drop ``tree``'s entries.
    A listing that fails leaves ``ds`` on its provisional tree (logged)."""
    try:
        record = await listing
    except Exception as exc:  # noqa: BLE001 - the mount serves on from its provisional tree
        log.error("%s: the first listing failed (%s); directories are listed as they are read until the dataset "
                  "is opened again", ds.ref.url, exc)
        return
    ds.settle(record, manifests)
    log.info("%s: manifest v%d taken; %d directories were listed on demand meanwhile", ds.ref.url, ds.version,
             tree.lists)
    await asyncio.sleep(SETTLE_GRACE)
    tree.drop()

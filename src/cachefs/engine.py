"""The read-through engine: manifest → index → local store → tiers (mirror, origin), one per cache directory per
process.

The engine composes the parts and is the one door the front ends (FUSE, fsspec, jobs) use:

* datasets: a manifest snapshot taken once per node, then every ``stat``/``ls``/``walk`` from it;
* files: :meth:`Engine.strategy` answers once per file which read strategy applies — large objects in blocks
  (:mod:`cachefs.read.block_strategy`), small ones packed (:mod:`cachefs.read.pack_strategy`) — and
  :meth:`Engine.open` hands back an :class:`~cachefs.read.OpenFile` through it;
* what misses goes through the tier chains (:mod:`cachefs.tiers`, built from ``engine.small_tiers`` and
  ``engine.block_tiers``) within the origin funnel's limits (:mod:`cachefs.node.funnel`); what comes next is
  fetched ahead by the prefetcher (:mod:`cachefs.prefetch`); writes within the disk's room
  (:mod:`cachefs.node.space`); eviction (:mod:`cachefs.node.eviction`) and access statistics
  (:mod:`cachefs.node.read_stats`) run in the background;
* the cache group: the agent serves its members through :meth:`Engine.serve`.

Two doors, one path: the async methods run on the cachefs event loop. Sync callers (fsspec files, FUSE handlers)
call ``read_local`` first, which serves what is on this node from the calling thread, and fall back to ``read``
through :func:`cachefs.base.aio.run_sync` on a miss.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import multiprocessing.util
import os
import threading
from collections.abc import Callable
from typing import Any

from cachefs.base.config import Config, prepare_cache_dir, resolve_size, tier_names
from cachefs.base.errors import ConfigError
from cachefs.base.memory import bound_allocator
from cachefs.base.types import DatasetRef, Entry, object_key
from cachefs.cluster.link import GroupLink
from cachefs.index import DatasetRecord, Index
from cachefs.index.caches import note_cache
from cachefs.index.counters import NodeCounters
from cachefs.index.hints import HintStore
from cachefs.manifest import ManifestStore, take_snapshot
from cachefs.manifest.dataset import Dataset
from cachefs.manifest.first import FirstManifests
from cachefs.manifest.shipping import ReceivedListing
from cachefs.node.admission import Admission
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.eviction import Eviction
from cachefs.node.funnel import OriginFunnel
from cachefs.node.open_objects import OpenObjects
from cachefs.node.pack_assembly import PackAssemblies
from cachefs.node.read_stats import ReadStats
from cachefs.node.scan_view import ScanView
from cachefs.node.space import DiskSpace
from cachefs.prefetch.orders import OrderBook
from cachefs.prefetch.prefetcher import Prefetcher
from cachefs.read import WOULD_WAIT, BlockStrategy, LocalRead, OpenFile, PackStrategy, ReadStrategy, ReadStream
from cachefs.read.node_figures import NodeFigures
from cachefs.read.ordered import OrderedLookahead
from cachefs.sources import Source, open_origin
from cachefs.store import DiskStore
from cachefs.store.pack_store import DiskPackStore
from cachefs.tiers import TierCounts, TierParts, build_chain
from cachefs.write.services import NodeServices

__all__ = ["WOULD_WAIT", "Dataset", "Engine", "LocalRead", "OpenFile", "ReadStream", "get_engine"]

log = logging.getLogger(__name__)


class Engine:
    """One per cache directory per process (see :func:`get_engine`)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        c, e = config.cache, config.engine
        prepare_cache_dir(c.dir)
        self.block_size = c.block_size
        self.index = Index(c.dir)
        note_cache(c.dir)  # (commands given no --cache-dir find it: cachefs.cli.which_cache)
        self.store = DiskStore(c.dir, c.block_size)
        self.manifests = ManifestStore(self.index)
        disk_total, disk_free = self.store.disk_usage()
        self.capacity = resolve_size(c.capacity, disk_total, "cache.capacity")
        self.min_free = resolve_size(c.min_free, disk_total, "cache.min_free")
        self.index.keep_reserve(disk_total, disk_free - self.min_free)  # see cachefs/index/reserve.py
        if e.bound_allocator:
            bound_allocator(min(c.block_size, 4 * 1024 * 1024))
        self.funnel = OriginFunnel(e.memory_budget, e.max_concurrent_fetches, e.fetch_window)
        self.budget = self.funnel.memory
        self.disk = DiskJobs()
        self.stats = ReadStats()
        self.objects = OpenObjects(self.index, self.store, c.block_size)
        pack_store = DiskPackStore(c.dir)
        self.space = DiskSpace(self.index, self.store, capacity=self.capacity, min_free=self.min_free,
                               high_watermark=c.high_watermark, low_watermark=c.low_watermark)
        #: Declared read orders (cachefs.prefetch.orders): what readers open next is fetched ahead of them, and
        #: what they have passed makes room for what is read ahead (eviction by next use).
        orders = OrderBook(c.dir)
        self.scans = ScanView(HintStore(self.index), self.stats, enabled=c.scan_admission)
        self.eviction = Eviction(config, self.space, pack_store, self.objects, self.stats, self.scans, self.disk)
        self.admission = Admission(self.space, self.eviction, self.scans, orders)
        self.assemblies = PackAssemblies(pack_store, self.index, self.admission, self.disk)
        self.prefetcher = Prefetcher(self.funnel.memory, max_running=e.max_concurrent_fetches)
        self.tier_counts = TierCounts()
        self.group = GroupLink(c.dir)
        parts = TierParts(config, self.funnel, self.group.view)
        #: What writable volumes on this node take from it (their memory, disk room and copies).
        self.node_services = NodeServices(self.budget, self.eviction.make_room, self.group.view)
        block_chain = build_chain(tier_names(e.block_tiers), parts, "block", self.tier_counts)
        small_chain = build_chain(tier_names(e.small_tiers), parts, "small", self.tier_counts)
        self.blocks = BlockStrategy(config, self.objects, block_chain, self.funnel, self.admission, self.disk,
                                    self.stats, self.prefetcher)
        self.packs = PackStrategy(config, pack_store, self.index, small_chain, self.funnel, self.admission, self.disk,
                                  self.stats, self.assemblies, self.prefetcher)
        self.ordered = OrderedLookahead(orders, self.prefetcher, self.strategy,
                                        min(e.order_lookahead, e.memory_budget // 8))
        self.figures = NodeFigures(self.stats, self.tier_counts, NodeCounters(self.index), self.space, self.budget,
                                   orders)
        self._sources: dict[tuple, Source] = {}
        self.first_manifests = FirstManifests(config, self.index, self.manifests)
        self._stats_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exited = False
        atexit.register(self._at_exit)
        if multiprocessing.parent_process() is not None:
            # A multiprocessing child (a DataLoader worker) ends in os._exit: exit hooks never run there, its
            # finalizers do. Without this, the small files it read would stay in unwritten packs and be lost.
            multiprocessing.util.Finalize(self, self._at_exit, exitpriority=100)

    def _at_exit(self) -> None:
        from cachefs.base import aio

        if self._exited:
            return
        self._exited = True

        loop = aio.get_loop() if self._sources or self.group.client is not None else None
        if loop is not None and loop.is_running():
            try:
                aio.run_sync(self.aclose(), timeout=5)
                return
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                pass
        self.close()

    # -- datasets -------------------------------------------------------------------------------------------
    def source_for(self, url: str, storage_options: dict[str, Any] | None = None) -> Source:
        key = (url.split("://", 1)[0], repr(sorted((storage_options or {}).items())))
        src = self._sources.get(key)
        if src is None:
            src = self._sources[key] = open_origin(url, self.config, storage_options)
        return src

    async def open_dataset(
        self, url: str, *, storage_options: dict[str, Any] | None = None, manifest_version: int | None = None,
        source: Source | None = None, lazy: bool = False,
    ) -> Dataset:
        """Open a dataset, taking its first manifest if the node has none. No origin request otherwise. With
        ``lazy``, a dataset the node has no manifest of opens after one listing of its root, as a provisional tree
        that lists directories as they are read (:mod:`cachefs.manifest.lazy`; where the origin lists directories)
        while the manifest is taken in the background."""
        if self._loop is None:
            # Exit hooks run last-registered first: registered again now, after the event loop's own hook, the
            # engine closes (its sessions included) while the loop still runs.
            atexit.unregister(self._at_exit)
            atexit.register(self._at_exit)
        self._loop = self.prefetcher.loop = asyncio.get_running_loop()
        ref = DatasetRef.from_url(url)
        src = source or self.source_for(ref.url, storage_options)
        rec = self.index.dataset(ref.id)
        if rec is None or not rec.manifests:
            if lazy and manifest_version is None and src.lists_directories:
                return await self.first_manifests.provisional(ref, src, self.group.manifest, storage_options,
                                                              apart=source is None)
            rec = await self.first_manifests.take(ref, src, self.group.manifest)
        version = rec.current if manifest_version is None else int(manifest_version)
        if rec.manifest(version) is None:
            have = ", ".join(str(m.version) for m in rec.manifests) or "none"
            raise ConfigError(f"{ref.url}: manifest version {version} is not on this node (have: {have})")
        m = rec.manifest(version)
        if m is not None and m.bytes > self.space.capacity * self.config.cache.high_watermark:
            self.stats.presume_scan(ref.id)  # larger than the cache: admitted as a scan until its reads say not
        return Dataset(ref, version, src, self.manifests, rec)

    async def refresh(self, url: str, *, storage_options: dict[str, Any] | None = None,
                      source: Source | None = None) -> DatasetRecord:
        """Take a new manifest snapshot; readers that open the dataset afterwards see it. In a cache group the
        members that know the dataset take the same snapshot (:meth:`GroupLink.push_manifest`)."""
        ref = DatasetRef.from_url(url)
        rec = await take_snapshot(self.index, source or self.source_for(ref.url, storage_options), ref,
                                  concurrency=self.config.origin.list_concurrency)
        await self.group.push_manifest(ref, self.manifests, rec.current)
        return rec

    async def adopt_manifest(self, url: str, entries: list[Entry]) -> DatasetRecord:
        """Take ``entries`` (a snapshot a group member listed) as a new manifest version of ``url``."""
        return await take_snapshot(self.index, ReceivedListing(entries), DatasetRef.from_url(url),
                                   concurrency=self.config.origin.list_concurrency)

    def known_dataset_for(self, url: str) -> DatasetRecord | None:
        """The dataset on this node whose URL is the longest prefix of ``url``."""
        best = None
        for rec in self.index.datasets():
            if (url == rec.url or url.startswith(rec.url + "/")) and (best is None or len(rec.url) > len(best.url)):
                best = rec
        return best

    # -- the cache group ------------------------------------------------------------------------------------
    def fetch_for_group(self) -> None:
        """This process (the agent) fetches missing bytes for the group, from the mirror and the origin, and
        asks the group only as a replica of a hot key (from the key's owner); what it gets, it keeps."""
        self.group.serving = True

    async def serve(self, ds: Dataset, entry: Entry, block: int | None, *, fetch: bool) -> tuple[bytes, int] | None:
        """Block ``block`` of a large file, or a whole small file (``block`` None), for a member of the cache group,
        with the checksum recorded for it: from this node's disk, or fetched first when ``fetch`` (this node owns
        the key). None when it is neither here nor this node's to fetch."""
        self._start_background()
        return await self.strategy(entry).serve(ds, entry, block, fetch=fetch)

    def dataset_record(self, ds_id: str) -> DatasetRecord | None:
        """What this node knows of dataset ``ds_id`` (its URL, manifest versions)."""
        return self.index.dataset(ds_id)

    def lookup(self, ds_id: str, version: int, path: str) -> Entry:
        """``path`` in manifest ``version`` of ``ds_id``; ObjectNotFoundError if it has none."""
        return self.manifests.lookup(ds_id, version, path)

    def pack_manifest(self, ds_id: str, version: int, url: str) -> bytes:
        """Manifest ``version`` of ``ds_id`` packed for a member of the group (blocking: call from a thread)."""
        from cachefs.manifest.shipping import pack_manifest

        return pack_manifest(self.manifests, ds_id, version, url)

    # -- files ----------------------------------------------------------------------------------------------
    def strategy(self, entry: Entry) -> ReadStrategy:
        """How ``entry`` is read, kept and served: packed whole if it is a small file, in blocks otherwise."""
        return self.packs if self.packs.packable(entry) else self.blocks

    def open(self, ds: Dataset, entry: Entry, *, pin: bool = True) -> OpenFile:
        """Open ``entry`` for reading: its strategy is chosen here, once. With ``pin``, eviction by any process
        leaves its cache file alone until the file is closed (a reader has it open)."""
        self.ordered.opened(ds, entry)
        return self.strategy(entry).open(ds, entry, pin=pin)

    def read_local(self, ds: Dataset, entry: Entry, start: int, end: int, stream: ReadStream | None = None, *,
                   wait: bool = True) -> LocalRead:
        """``[start, end)`` of ``entry`` from this node, from the calling thread (see OpenFile.read_local)."""
        if stream is None or not stream.counted:
            self.ordered.opened(ds, entry)
        return self.strategy(entry).oneoff(ds, entry, stream).read_local(start, end, wait=wait)

    async def read(self, ds: Dataset, entry: Entry, start: int, end: int, stream: ReadStream | None = None
                   ) -> bytes | bytearray:
        """``[start, end)`` of ``entry`` (clamped to its size), fetching what is missing."""
        self._start_background()
        if stream is None or not stream.counted:
            self.ordered.opened(ds, entry)
        return await self.strategy(entry).oneoff(ds, entry, stream).read(start, end)

    async def ensure_cached(self, ds: Dataset, entry: Entry, on_bytes: Callable[[int], None] | None = None) -> None:
        """Make ``entry`` wholly present (prefetch); CacheFullError if the disk cannot take it. ``on_bytes(n)``
        as pieces land. Warming is not a read: it counts neither hits nor misses, nor read-ahead."""
        self._start_background()
        await self.strategy(entry).ensure(ds, entry, on_bytes)
        if self.strategy(entry).packed:
            full = self.packs.refused()
            if full is not None:
                raise full

    async def persist(self) -> None:
        """Write pending packs now and get back under the cache's limits (the end of a prefetch). Raises
        CacheFullError if small files could not be stored."""
        await self.prefetcher.drain()
        await self.blocks.chain.drain()
        await self.packs.chain.drain()
        await self.assemblies.drain()
        await self.packs.pending.flush()
        full = self.packs.refused()
        if full is not None:
            raise full
        if self.space.over_limits():
            await self.trim()

    def cached_bytes(self, ds: Dataset, entry: Entry) -> int:
        return self.strategy(entry).cached_bytes(ds, entry, self.object_key(ds, entry))

    def local_path(self, ds: Dataset, entry: Entry) -> str | None:
        """Path of the complete local file of a large ``entry``, or None (missing blocks, packed, evicted)."""
        return self.strategy(entry).local_path(ds, entry)

    def every_file_packed_here(self, ds: Dataset, *, here: bool = True) -> bool:
        """Whether every file of ``ds`` is a packed small file (and, with ``here``, on this node). May walk the
        manifest: not from a request thread."""
        info = ds.record.manifest(ds.version)
        if info is None or info.largest is None or info.largest > self.packs.threshold:
            return False
        if not here:
            return True
        # (Cached bytes count every version of the dataset's objects, so only falling short is conclusive.)
        if self.index.dataset_stats(ds.ref.id).cached_bytes < info.bytes:
            return False
        return all(self.cached_bytes(ds, e) == e.size for e in ds.walk_files())

    def dataset_cached_bytes(self, ds: Dataset) -> int:
        return self.index.dataset_stats(ds.ref.id).cached_bytes

    def room(self) -> int:
        """Bytes the cache can still take (capacity and free-space floor)."""
        return self.space.room()

    @staticmethod
    def object_key(ds: Dataset, entry: Entry) -> bytes:
        return object_key(ds.ref.id, entry.path, entry.version)

    # -- background work ------------------------------------------------------------------------------------
    def flush_stats(self) -> None:
        """Write batched access statistics to the index and the metrics, let go of descriptors of evicted files,
        and put the index's reserve back if it was spent."""
        self.packs.reads.close_unlinked()
        self.objects.close_evicted()
        self.eviction.flush_stats()
        self.figures.flush()
        try:
            total, free = self.store.disk_usage()
            self.index.keep_reserve(total, free - self.min_free)
        except OSError as exc:
            log.debug("index reserve: %s", exc)

    async def start_background(self) -> None:
        """Start the periodic statistics flush now (it otherwise starts with the first read that reaches the
        event loop, which a FUSE daemon on a warm cache never makes)."""
        self._start_background()

    def _start_background(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.ensure_future(self._stats_loop())

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.engine.stats_flush_interval)
            await asyncio.to_thread(self.flush_stats)
            self.group.refresh()

    # -- eviction (cachefs.node.eviction) ------------------------------------------------------------------
    async def trim(self) -> int:
        """If usage is past the cache's limits, evict until it is under the low watermark; bytes freed."""
        return await self.disk.run(self.eviction.trim)

    async def make_room(self, need: int = 0) -> int:
        """Evict until usage is under the low watermark and ``need`` more bytes fit; bytes freed."""
        return await self.disk.run(self.eviction.make_room, need)

    async def purge(self, dataset: str) -> int:
        """Evict all of ``dataset`` that no reader holds; this process lets go of what it still had open of it at
        once. Bytes freed."""
        freed = await self.disk.run(self.eviction.purge, dataset)
        self.objects.close_evicted()
        self.packs.reads.close_unlinked()
        return freed

    def purge_sync(self, dataset: str | None = None) -> int:
        """From a thread: all of ``dataset`` (None: of every dataset) that no reader holds; bytes freed."""
        return self.eviction.purge(dataset) if dataset is not None else self.eviction.purge_all()

    # -- closing --------------------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop fetching, let every write finish, write pending packs, release the origin connections, then
        :meth:`close` the files. In that order: a file is never closed under a write still running."""
        fetches = [*self.prefetcher.stop(), *self.blocks.stop(), *self.packs.stop()]
        for task in fetches:
            task.cancel()
        await asyncio.gather(*fetches, return_exceptions=True)
        await self.assemblies.drain()
        await self.packs.pending.flush()
        for job in (self._stats_task, self.eviction.trimming(), *self.first_manifests.background()):
            if job is not None and not job.done():
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
        await self.disk.drain()  # block writes the cancelled fetches started
        sources, self._sources = list(self._sources.values()), {}
        for src in sources:
            await src.close()
        await self.group.close()
        self.close()

    def close(self) -> None:
        """Write pending packs, flush statistics and close every open object file (call :meth:`aclose` from the
        event loop instead while fetches may be running). The engine stays usable: files open again."""
        self.disk.wait()
        self.packs.pending.flush_sync()
        self.assemblies.close()
        self.flush_stats()
        self.objects.close_all()


_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def _forget_engines_in_child() -> None:
    # A forked child must not use its parent's engines: their loop has no thread here, and LMDB forbids using an
    # environment across fork. They are dropped unclosed (closing would write the parent's state); the child
    # opens its own on first use.
    global _engines_lock
    _engines.clear()
    _engines_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_engines_in_child)


def get_engine(config: Config) -> Engine:
    """The process's engine for ``config.cache.dir`` (one per cache dir, so single-flight spans every user)."""
    key = os.path.realpath(config.cache.dir)
    with _engines_lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _engines[key] = Engine(config)
        return eng

"""Fetching the blocks of large objects: one fetch at a time per block in this process (single-flight: a hundred
readers of one cold block cause one GET and share its bytes), through the origin funnel and the tier chain, and
stored (written, then recorded in the index) when admission finds the disk room for it.

A block the disk has no room for (:class:`~cachefs.node.space.DiskSpace`) is served all the same and kept in memory
for its readers (least recently used out, within :attr:`BlockFetches.unstored_limit`): the kernel reads a 4 MiB
block in 1 MiB pieces, and read-ahead runs ahead of the reader, so a reader streaming past a full disk gets
the origin's speed.
"""

from __future__ import annotations

import asyncio
import functools

from cachefs.base.checksum import block_checksum
from cachefs.base.config import Config
from cachefs.base.errors import CacheFullError
from cachefs.base.types import Entry
from cachefs.manifest.dataset import Dataset
from cachefs.node.admission import Admission
from cachefs.node.budget import Reservation
from cachefs.node.bytes_lru import BytesLRU
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.flight import SingleFlight
from cachefs.node.funnel import OriginFunnel
from cachefs.node.open_objects import OpenObject, OpenObjects
from cachefs.node.read_stats import ReadStats
from cachefs.tiers import Keep, TierChain, Want

__all__ = ["BlockFetches"]


class BlockFetches:
    def __init__(self, config: Config, objects: OpenObjects, chain: TierChain, funnel: OriginFunnel,
                 admission: Admission, disk: DiskJobs, stats: ReadStats) -> None:
        self.block_size = config.cache.block_size
        self.objects, self.chain, self.funnel, self.admission, self.disk, self.stats = (
            objects, chain, funnel, admission, disk, stats)
        self._fetches = SingleFlight()  # (object key, block) → (bytes, stored, guest)
        #: Blocks a full disk could not take, kept for their readers (see the module docstring).
        self.unstored_limit = min(config.engine.readahead_max, config.engine.memory_budget // 4)
        self._unstored = BytesLRU(self.unstored_limit)  # (object key, block) → bytes
        self.closing = False

    def under_way(self, okey: bytes, idx: int) -> bool:
        """Whether block ``idx`` of ``okey`` is being fetched, or is kept in memory: no need to ask for it."""
        return (okey, idx) in self._fetches or (okey, idx) in self._unstored

    def fetching(self, okey: bytes, idx: int) -> bool:
        return (okey, idx) in self._fetches

    def kept(self, okey: bytes, blocks: list[int]) -> dict[int, bytes]:
        """Those of ``blocks`` kept in memory for want of disk room, by index."""
        if not self._unstored:
            return {}
        got = {i: self._unstored.get((okey, i)) for i in blocks}
        return {i: data for i, data in got.items() if data is not None}

    async def bring(self, ds: Dataset, entry: Entry, ob: OpenObject, idx: int, *, held: Reservation | None = None,
                    strict: bool = False) -> bytes | None:
        """Make block ``idx`` present; its bytes if this call fetched them (single-flight). ``held``: memory
        reserved for it already (read-ahead), handed to the fetch or given back. ``strict``: CacheFullError if
        the disk could not take it."""
        key = (ob.key, idx)
        fut = self._fetches.get(key)
        if fut is None:
            if self.objects.has(ob, idx):
                if held is not None:
                    await held.release()
                return None
            fut = self._fetches.start(key, self._fetch(ds, entry, ob, idx, held))
        elif held is not None:
            await held.release()
        data, stored, guest = await asyncio.shield(fut)
        if strict and not stored and not guest:
            raise CacheFullError(f"cache disk full: cannot store {entry.path} (capacity {self.admission.space.capacity} B)")
        if not stored:
            self._unstored.put(key, data)
        return data

    async def _fetch(self, ds: Dataset, entry: Entry, ob: OpenObject, idx: int, held: Reservation | None
                     ) -> tuple[bytes | bytearray, bool, bool]:
        """(the block, whether it was stored here, whether it is a guest: kept by the group member owning it,
        stored here too or not)."""
        start = idx * self.block_size
        length = min(self.block_size, entry.size - start)
        async with held or await self.funnel.hold(length):
            served = await self.chain.fetch(Want(ds, entry, ob.key, start, length))
            data, guest = served.data, served.keep is not Keep.OWN
            if served.keep is Keep.NONE:
                return data, False, True
            if guest and self.objects.has(ob, idx):
                return data, True, True  # (this node's agent owns it and stored it as it answered)
            checksum = block_checksum(data)
            stored = await self._store(ob, idx, data, checksum, guest=guest)
            if not stored and ob.stale and not self.closing:
                # Its file was evicted or rewritten (guest blocks out) while the block was on its way: the block
                # goes into the object's file as it is now, not into the memory of one process.
                with self.objects.using(ds.ref.id, entry, ob.key) as fresh:
                    stored = await self._store(fresh, idx, data, checksum, guest=guest)
        return data, stored, guest  # (a guest a full disk could not take is no error: its owner keeps it)

    async def _store(self, ob: OpenObject, idx: int, data: bytes | bytearray, checksum: int, *,
                     guest: bool = False) -> bool:
        """Write block ``idx`` and record it (as guest data: evicted first), if the disk has room; whether it did."""
        if self.closing or ob.stale:
            return False
        write = functools.partial(self.objects.write_block, ob, idx, data, checksum, guest=guest)
        if guest:
            stored = await self.disk.run(self.admission.store_guest, len(data), write)
        else:
            dataset = ob.record.dataset
            small = len(data) < 256 * 1024 and not self.admission.scanning(dataset)  # (a scan is admitted otherwise)
            decided, stored = self.admission.space.try_store(len(data), write) if small else (False, None)
            if not decided:
                # (a block read ahead may take the room of files the readers of declared orders have passed)
                ahead = self.stats.block_ahead(ob.key, idx)
                stored = await self.disk.run(functools.partial(self.admission.store, ahead=ahead), len(data), write,
                                             dataset)
        if not stored:
            return False
        self.objects.note_present(ob, idx, checksum, len(data))
        self.admission.note_stored(len(data))
        return True

    def stop(self) -> list[asyncio.Future]:
        """Stop starting fetches; those in flight (for the caller to cancel and await)."""
        self.closing = True
        return [*self._fetches.runs(), *self.chain.stop()]

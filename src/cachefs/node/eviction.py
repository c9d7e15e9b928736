"""Eviction: taking cached objects and packs out of the cache, in the order of the eviction policy.

When cached bytes pass ``high_watermark × capacity`` or the disk's free space drops under ``min_free``, whole
objects and packs are removed until usage is under ``low_watermark × capacity`` (:meth:`Eviction.trim`; a writer
that needs room asks :meth:`Eviction.make_room`): first guest data (in a cache group, what another member owns and
this node keeps a copy of: docs/CLUSTER.md), then the node's own in the order of the eviction policy
(:mod:`.eviction_policy`, two-touch LRU by default), which never offers staged bytes nor what a running prefetch
job brought. The node's own data is evicted only while it alone is over the target: never for guest data that
readers hold at the moment. What an epoch scan kept since it began (:mod:`.scan`) goes only while usage is over the
high watermark, the line its admission (:mod:`.admission`) keeps to; room for the scan's own bytes is made by
:meth:`Eviction.make_room_for_scan`. An object a reader holds (any process: a shared ``flock``) is skipped; a pack
goes without waiting for readers, who read on from the unlinked file. Guest blocks go from an object's file by
rewriting it without them (:meth:`~cachefs.store.base.BlockStore.try_keep_only`), so the blocks it owns stay.

Every so often as bytes are stored (:meth:`Eviction.note_stored`) the limits are checked; past them,
:meth:`Eviction.trim` runs in the background (:meth:`Eviction.trimming` is it, for shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable

from cachefs.base.config import Config
from cachefs.base.errors import CacheFullError
from cachefs.index.records import ObjectRecord, PackRecord
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.eviction_policy import Candidate, EvictionHints, policy_named
from cachefs.node.open_objects import OpenObjects
from cachefs.node.read_stats import ReadStats
from cachefs.node.scan_view import ScanView
from cachefs.node.space import DiskSpace
from cachefs.store.base import PackStore

__all__ = ["KEEP_LEASE_TTL", "Eviction"]

log = logging.getLogger(__name__)

#: Seconds a prefetch job's "keep what I brought" lease lasts unless renewed (it is renewed at a third of that).
KEEP_LEASE_TTL = 60.0


class Eviction:

    def __init__(self, config: Config, space: DiskSpace, packs: PackStore, objects: OpenObjects, stats: ReadStats,
                 scans: ScanView, disk: DiskJobs) -> None:
        c = config.cache
        self.space, self.capacity, self.min_free = space, space.capacity, space.min_free
        self.high = int(self.capacity * c.high_watermark)
        self.low = int(self.capacity * c.low_watermark)
        self.index, self.files = space.index, space.store  # (the object files)
        self.packs, self.objects, self.stats, self.scans = packs, objects, stats, scans
        self.disk = disk
        self.hot_dir_half_life = config.engine.hot_dir_half_life
        self.policy = policy_named(c.eviction_policy)
        self.hints = scans.hints
        self._one_at_a_time = threading.Lock()
        # Limits are checked (an index read and a statvfs) every this many stored bytes rather than per write:
        # half the room between the high watermark and the capacity, so usage still never passes capacity.
        self._check_every = max(1, min(64 << 20, int(self.capacity * (1 - c.high_watermark) / 2)))
        self._stored_since_check = 0
        self._trimming: asyncio.Future | None = None
        #: Bytes of files readers had passed, evicted for bytes fetched ahead of them, since start.
        self.passed_evicted = 0

    # -- what the policy knows ------------------------------------------------------------------------------
    def flush_stats(self) -> None:
        """Access statistics into the index first, so that the order is current (and this process's scans)."""
        self.stats.flush(self.index, self.objects.take_access(), self.hot_dir_half_life)
        self.scans.publish()

    def current_hints(self, *, keep: bool = True) -> EvictionHints:
        """The node's eviction hints now (``keep``: with the prefetch jobs' leases and the pinned datasets; an
        explicit purge asks without)."""
        return EvictionHints(self.hints.kept_newer_than() if keep else None, self.hints.staged(),
                             self.hints.pinned() if keep else frozenset())

    @contextlib.asynccontextmanager
    async def keeping_newer_than(self, since: float) -> AsyncIterator[None]:
        """While the block runs, no process on the node evicts what was used at or after ``since`` (a prefetch job:
        what it brings stays while it brings the rest). Held as a lease in the index, renewed on the event loop."""
        name = f"{os.getpid()}-{id(object())}-{since}"
        self.hints.keep_newer_than(name, since, KEEP_LEASE_TTL)

        async def renew() -> None:
            while True:
                await asyncio.sleep(KEEP_LEASE_TTL / 3)
                await asyncio.to_thread(self.hints.keep_newer_than, name, since, KEEP_LEASE_TTL)

        renewing = asyncio.ensure_future(renew())
        try:
            yield
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            self.hints.release(name)

    def note_stored(self, nbytes: int) -> None:
        """``nbytes`` more are on the disk (from the event loop): writes may go on, and every so often the limits
        are checked; past them, :meth:`trim` runs in the background."""
        self.space.clear()
        self._stored_since_check += nbytes
        if self._stored_since_check >= self._check_every:
            self._stored_since_check = 0
            if self.space.over_limits() and (self._trimming is None or self._trimming.done()):
                self._trimming = asyncio.ensure_future(self.disk.run(self.trim))

    def trimming(self) -> asyncio.Future | None:
        """The trim running in the background, if any."""
        return self._trimming

    # -- operations (blocking: a disk thread) ---------------------------------------------------------------
    def trim(self) -> int:
        """If usage is past the limits: evict until it is under the low watermark. Bytes freed."""
        total, _ = self.index.totals()
        _, free = self.files.disk_usage()
        if total <= self.high and free >= self.min_free:
            return 0
        with self._one_at_a_time:
            return self._sweep(0)

    def make_room(self, need: int) -> int:
        """Evict so that ``need`` more bytes fit, and usage is under the low watermark (one eviction at a time in
        this process); bytes freed."""
        with self._one_at_a_time:
            freed = self._sweep(need)
        if freed:
            self.space.clear()
        return freed

    def purge(self, dataset: str) -> int:
        """Evict all of ``dataset`` that no reader holds (staged bytes stay); bytes freed."""
        return self._purge(dataset)

    def purge_all(self) -> int:
        """Evict everything no reader holds (staged bytes stay); bytes freed."""
        return self._purge(None)

    def make_guest_room(self, need: int) -> int:
        """Evict guest data so that ``need`` more bytes of it fit under the high watermark; bytes freed."""
        with self._one_at_a_time:
            self.flush_stats()
            return self._evict_guests(min(self.low, self.high - need), self.floor_for(need))

    def make_room_for_scan(self, dataset: str, since: float, target: int, floor: float,
                           passed: Callable[[str, str], bool] | None = None) -> int:
        """Room for a scanned dataset's bytes, down to ``target`` bytes used and ``floor`` free: guest data; then, for
        bytes fetched ahead of a reader, the scan's own files ``passed(dataset, path)`` says its readers have passed
        (eviction by next use: they are not read again before the next epoch); then what the policy offers of other
        datasets' bytes that nobody used since the scan began. Never the scan's own bytes otherwise: a miss does not
        displace the kept part. Bytes freed. (``passed`` is handed down for the call: the declared orders sit above
        this layer.)"""
        with self._one_at_a_time:
            self.flush_stats()
            freed = self._evict_guests(target, floor)
            if self.under(target, floor):
                return freed
            hints = self.current_hints()
            own: list[Candidate] = []
            others = [Candidate(None, p) for p in self.index.packs() if p.dataset != dataset and p.last_access < since]
            for okey, rec in self.index.objects():  # (one pass over the objects for both lists)
                if rec.dataset != dataset:
                    if rec.last_access < since:
                        others.append(Candidate(okey, rec))
                elif passed is not None and passed(dataset, rec.path):
                    # Only objects: a pack holds many files, most of them still ahead in a shuffled order.
                    own.append(Candidate(okey, rec))
            got = self._evict_down_to(self.policy.order(own, hints), target, floor)
            self.passed_evicted += got
            return freed + got + self._evict_down_to(self.policy.order(others, hints), target, floor)

    def floor_for(self, need: int) -> float:
        """The free bytes to keep when ``need`` more are to be written."""
        return max(self.min_free * 1.1, self.min_free + need)

    def under(self, target: int, floor: float) -> bool:
        """Whether usage is at most ``target`` bytes with at least ``floor`` bytes free."""
        total, _ = self.index.totals()
        _, free = self.files.disk_usage()
        return total <= target and free >= floor

    # -- inside -----------------------------------------------------------------------------------------------
    def _sweep(self, need: int) -> int:
        """Guests, then the node's own in the policy's order, until usage is under the low watermark and ``need``
        more bytes fit; a scan's kept part only down to the high watermark."""
        self.flush_stats()
        target, floor = min(self.low, self.capacity - need), self.floor_for(need)
        freed = self._evict_guests(target, floor)
        # The node's own data is not evicted for guests' sake (it would only be fetched from the origin again):
        # not when what is over the target is guest data readers hold right now, nor to go from the high
        # watermark down to the low one once evicting guests got usage under the high one.
        guests = self.index.guest_bytes()
        if guests and self.index.totals()[0] - guests <= target:
            return freed
        if freed and self.under(self.high - need, floor):
            return freed
        scans = self.scans.scans()

        def kept_by_scan(v: Candidate) -> bool:
            scan = scans.get(v.record.dataset)
            return scan is not None and v.last_access >= scan.since

        kept: list[Candidate] = []
        others: list[Candidate] = []
        for v in self._candidates(None):
            (kept if kept_by_scan(v) else others).append(v)
        hints = self.current_hints()
        freed += self._evict_down_to(self.policy.order(others, hints), target, floor)
        freed += self._evict_down_to(self.policy.order(kept, hints), min(self.high, self.capacity - need), floor)
        if freed:
            log.info("evicted %d bytes", freed)
        return freed

    def _purge(self, dataset: str | None) -> int:
        self.flush_stats()
        victims = self.policy.order(self._candidates(dataset), self.current_hints(keep=False))
        freed = self._evict_down_to(victims, None, 0)
        if freed:
            log.info("evicted %d bytes", freed)
        return freed

    def _candidates(self, dataset: str | None) -> list[Candidate]:
        return [*(Candidate(okey, rec) for okey, rec in self.index.objects(dataset)),
                *(Candidate(None, p) for p in self.index.packs(dataset))]

    def _evict_down_to(self, victims: list[Candidate], target: int | None, floor: float) -> int:
        """Evict ``victims`` in order until usage is at most ``target`` with ``floor`` bytes free (None: all of
        them that no reader holds); bytes freed."""
        freed = 0
        for victim in victims:
            if target is not None and self.under(target, floor):
                break
            try:
                freed += self._evict_one(victim.okey, victim.record)
            except CacheFullError as exc:  # not even the index's reserve let it commit
                log.error("eviction stopped: %s", exc)
                break
        return freed

    def _evict_guests(self, target: int, floor: float) -> int:
        """Guest data first, least recently used first: guest packs whole, guest blocks out of their objects."""
        blocks, pack_keys = self.index.guests()
        if not (blocks or pack_keys):
            return 0
        victims: list[tuple[float, PackRecord | tuple[bytes, ObjectRecord, list[int]]]] = []
        for pkey in pack_keys:
            pack = self.index.pack(pkey)
            if pack is not None:
                victims.append((pack.last_access, pack))
        for okey, idxs in blocks.items():
            obj = self.index.object(okey)
            if obj is not None:
                victims.append((obj.last_access, (okey, obj, idxs)))
        freed = 0
        for _, what in sorted(victims, key=lambda v: v[0]):
            if self.under(target, floor):
                break
            try:
                if isinstance(what, PackRecord):
                    freed += self._evict_one(None, what)
                else:
                    freed += self._evict_guest_blocks(*what)
            except CacheFullError as exc:
                log.error("eviction stopped: %s", exc)
                break
        return freed

    def _evict_guest_blocks(self, okey: bytes, rec: ObjectRecord, guests: list[int]) -> int:
        if not self.objects.close_idle(okey):
            return 0  # a reader here holds it
        gone = set(guests)
        freed: list[int] = []

        def keep() -> list[int]:  # (under the file's exclusive lock: a block written meanwhile is counted)
            return [i for i in self.index.blocks_of(okey) if i not in gone]

        def forget() -> bool:
            freed.append(self.index.evict_guest_blocks(okey, guests))
            return True

        return sum(freed) if self.files.try_keep_only(okey, rec.dataset, keep, forget) else 0

    def _evict_one(self, okey: bytes | None, rec: ObjectRecord | PackRecord) -> int:
        if okey is None:  # a pack: the index forgets it and its members, then the file goes
            assert isinstance(rec, PackRecord)
            freed = self.index.remove_pack(rec.dataset, rec.pack_id)
            self.packs.remove(rec.dataset, rec.pack_id)
            return freed
        if not self.objects.close_idle(okey):
            return 0  # a reader here holds it (the exclusive lock would fail anyway)
        removed: list[int] = []

        def forget() -> bool:
            removed.append(self.index.remove_object(okey))
            return True

        return sum(removed) if self.files.try_remove(okey, rec.dataset, forget) else 0

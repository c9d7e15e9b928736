"""Eviction: which cached objects and packs go when the cache passes its limits, taking them out, and the one
"evict, then try once more" rule every writer of cached bytes follows (:meth:`Evictor.store`).

When cached bytes pass ``high_watermark × capacity`` or the disk's free space drops under ``min_free``, whole
objects and packs are removed until usage is under ``low_watermark × capacity`` (and, when a write asked for
room, until it fits): first guest data (in a cache group, what another member owns and this node keeps a copy of:
docs/CLUSTER.md), then the node's own in the order of the eviction policy (:mod:`.eviction_policy`, two-touch
LRU by default), which never offers staged bytes nor what a running prefetch job brought. The node's own data is
evicted only while it alone is over the target: never for guest data that readers hold at the moment.

A dataset read as an epoch scan (:mod:`.scan`) is admitted differently: only under the high watermark, into room
taken from guest data and from what nobody used since the scan began, never from the scan's own bytes; and the
sweep to the low watermark takes what the scan kept only while usage is over the high one. So the part of it that
fits stays from one epoch to the next, and the rest passes through uncached (a hit ratio of the fraction that
fits, where LRU gets 15 % at half). An object
a reader holds (any process: a shared ``flock``) is skipped; a pack goes without waiting for readers, who read on
from the unlinked file. Guest blocks go from an object's file by rewriting it without them
(:meth:`~cachefs.store.base.BlockStore.try_keep_only`), so the blocks it owns stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from cachefs.base.config import Config
from cachefs.base.errors import CacheFSError, CacheFullError
from cachefs.index.hints import HintStore, ScanRecord
from cachefs.index.records import ObjectRecord, PackRecord
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.eviction_policy import Candidate, EvictionHints, policy_named
from cachefs.node.open_objects import OpenObjects
from cachefs.node.read_stats import ReadStats
from cachefs.node.space import FULL_BACKOFF, DiskSpace
from cachefs.store.base import PackStore

__all__ = ["KEEP_LEASE_TTL", "Evictor"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds a prefetch job's "keep what I brought" lease lasts unless renewed (it is renewed at a third of that).
KEEP_LEASE_TTL = 60.0


class Evictor:
    def __init__(self, config: Config, space: DiskSpace, packs: PackStore, objects: OpenObjects, stats: ReadStats,
                 disk: DiskJobs) -> None:
        self.config, self.space = config, space
        self.capacity, self.min_free = space.capacity, space.min_free
        self.index, self.files = space.index, space.store  # (the object files; `store` is the admission rule)
        self.packs, self.objects, self.stats, self.disk = packs, objects, stats, disk
        self.policy = policy_named(config.cache.eviction_policy)
        self.hints = HintStore(self.index)
        self._one_at_a_time = threading.Lock()
        # Limits are checked (an index read and a statvfs) every this many stored bytes rather than per write:
        # half the room between the high watermark and the capacity, so usage still never passes capacity.
        self._check_every = max(1, min(64 << 20, int(self.capacity * (1 - config.cache.high_watermark) / 2)))
        self._stored_since_check = 0
        self._background: asyncio.Future | None = None
        self._guests_full_until = 0.0  # (guest writes refused at once until then: no scan of guests per block)
        self._scans: dict[str, ScanRecord] = {}  # the node's scans, as last read from the index
        self._scans_read = self._scans_published = 0.0
        self._scan_full_until: dict[str, float] = {}  # a scan's writes refused at once until then
        self._ahead_full_until: dict[str, float] = {}  # a scan's reading ahead paused until then (ahead_refusing)
        #: Bytes of scanned datasets not admitted (served without caching) since start.
        self.scan_refused = 0
        #: Bytes of files readers had passed, evicted for bytes fetched ahead of them, since start.
        self.passed_evicted = 0

    # -- scans ----------------------------------------------------------------------------------------------
    def scans(self) -> dict[str, ScanRecord]:
        """The datasets read as epoch scans on this node (any process), re-read from the index once a second."""
        if not self.config.cache.scan_admission:
            return {}
        now = time.monotonic()
        if now - self._scans_read > 1.0:
            self._scans_read = now
            try:
                published = self.hints.scans()
            except CacheFSError as exc:
                log.debug("scans not read: %s", exc)
                published = self._scans
            # (this process's own, before its next publishing)
            self._scans = {**self.stats.scan_records(), **published}
        return self._scans

    def scanning(self, dataset: str) -> bool:
        return dataset in self.scans()

    def ahead_refusing(self, dataset: str) -> bool:
        """Whether reading ahead in a scanned dataset is paused: the disk refused bytes read ahead of its readers
        (nothing passed yet to make room), and what the disk does not keep waits in memory among the readers' own
        misses, which can push it out before its reader comes (it is then fetched twice)."""
        return time.monotonic() < self._ahead_full_until.get(dataset, 0.0)

    def scan_refusing(self, dataset: str) -> bool:
        """Whether a scanned dataset's writes are being refused at once (it has no room left)."""
        return time.monotonic() < self._scan_full_until.get(dataset, 0.0)

    def publish_scans(self) -> None:
        """Publish this process's scans (at most once a second)."""
        now = time.monotonic()
        if now - self._scans_published < 1.0:
            return
        self._scans_published = now
        records = self.stats.scan_records()
        if records:
            try:
                self.hints.note_scans(records)
            except CacheFSError as exc:
                log.debug("scans not published: %s", exc)
            self._scans_read = 0.0  # read them back with the others' at the next look

    # -- writers ----------------------------------------------------------------------------------------------
    def store(self, nbytes: int, write: Callable[[], T], dataset: str | None = None, *,
              passed: Callable[[str, str], bool] | None = None) -> T | None:
        """Run ``write()`` (which puts ``nbytes`` on the disk and may raise :class:`CacheFullError`) if there is
        room, evicting once if there is not; None when the bytes were not stored. ``dataset``: whose bytes they
        are (a scanned dataset's are admitted as the module says). ``passed``, for bytes fetched ahead of a reader
        that has not read them yet: ``passed(dataset, path)`` tells whether every declared read order holding that
        file has had its reader go past it this epoch; such files of a scanned dataset make room for these bytes
        first (eviction by next use: they are not read again before the next epoch). Blocking: a disk thread."""
        if dataset is not None:
            scan = self.scans().get(dataset)
            if scan is not None:
                return self._store_for_scan(dataset, scan.since, nbytes, write, passed)
        if self.space.full:
            self.space.refused += 1
            return None
        for attempt in (0, 1):
            if self.space.admits(nbytes):
                try:
                    return write()
                except CacheFullError:
                    pass
            if attempt == 0:
                self.make_room(nbytes)
        self.space.mark_full()
        return None

    def scan_room(self, dataset: str, need: int) -> int:
        """Bytes a scanned dataset's writes may take now (evicting for it first, as :meth:`store` would, if
        ``need`` does not fit); 0 while its writes are refused. Blocking: a disk thread."""
        scan = self.scans().get(dataset)
        if scan is None:
            return self.space.room()
        if time.monotonic() < self._scan_full_until.get(dataset, 0.0):
            return 0
        limit = int(self.capacity * self.config.cache.high_watermark)
        floor = max(self.min_free * 1.1, self.min_free + need)
        if not self._under(limit - need, floor):
            with self._one_at_a_time:
                self._evict_for_scan(dataset, scan.since, limit - need, floor)
        room = self.space.room_under_high()
        if room < need:
            self._scan_full_until[dataset] = time.monotonic() + FULL_BACKOFF
        return room

    def _store_for_scan(self, dataset: str, since: float, nbytes: int, write: Callable[[], T],
                        passed: Callable[[str, str], bool] | None) -> T | None:
        c = self.config.cache
        limit = int(self.capacity * c.high_watermark) - nbytes
        floor = max(self.min_free * 1.1, self.min_free + nbytes)
        # What fits without evicting is written even while the scan's writes back off (the part of a pack that
        # fits the last room: scan_room).
        for evict_first in (False, True):
            if evict_first:
                if time.monotonic() < self._scan_full_until.get(dataset, 0.0):
                    break
                with self._one_at_a_time:
                    self._evict_for_scan(dataset, since, limit, floor, passed)
            if self._under(limit, floor):
                try:
                    return write()
                except CacheFullError:
                    pass
        else:
            self._scan_full_until[dataset] = time.monotonic() + FULL_BACKOFF
        if passed is not None:
            self._ahead_full_until[dataset] = time.monotonic() + FULL_BACKOFF
        self.scan_refused += nbytes
        return None

    def _evict_for_scan(self, dataset: str, since: float, target: int, floor: float,
                        passed: Callable[[str, str], bool] | None = None) -> int:
        """Room for a scan's bytes: guest data; then, for bytes fetched ahead of a reader (``passed`` given: see
        :meth:`store`), the scan's own files its readers have passed this epoch; then what the policy offers of
        other datasets' bytes that nobody used since the scan began. Never the scan's own bytes otherwise: a miss
        does not displace the pinned part."""
        self.flush_stats()
        freed = self._evict_guests(target, floor)
        if self._under(target, floor):
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
        victims = self.policy.order(own, hints) + self.policy.order(others, hints)
        for victim in victims:
            if self._under(target, floor):
                break
            try:
                got = self._evict_one(victim.okey, victim.record)
            except CacheFullError as exc:
                log.error("eviction stopped: %s", exc)
                break
            freed += got
            if victim.record.dataset == dataset:
                self.passed_evicted += got
        return freed

    def store_guest(self, nbytes: int, write: Callable[[], T]) -> T | None:
        """:meth:`store` for guest data (another group member owns it): written only into room under the high
        watermark, making room by evicting other guest data only, never what the node owns; None when not
        stored, which is no error (its owner keeps it). Blocking: a disk thread."""
        if time.monotonic() < self._guests_full_until:
            return None
        for attempt in (0, 1):
            if nbytes <= self.space.guest_room():
                try:
                    return write()
                except CacheFullError:
                    pass
            if attempt == 0:
                self.make_guest_room(nbytes)
        self._guests_full_until = time.monotonic() + FULL_BACKOFF
        return None

    def make_guest_room(self, need: int) -> int:
        """Evict guest data so that ``need`` more bytes of it fit under the high watermark; bytes freed."""
        c = self.config.cache
        with self._one_at_a_time:
            self.flush_stats()
            target = min(int(self.capacity * c.low_watermark), int(self.capacity * c.high_watermark) - need)
            return self._evict_guests(target, max(self.min_free * 1.1, self.min_free + need))

    def make_room(self, need: int) -> int:
        """Evict so that ``need`` more bytes fit (one eviction at a time in this process); bytes freed."""
        with self._one_at_a_time:
            freed = self.evict(force=True, need=need)
        if freed:
            self.space.clear()
        return freed

    def note_stored(self, nbytes: int) -> None:
        """``nbytes`` more are on the disk (from the event loop): writes may go on, and every so often the limits
        are checked and eviction started in the background if they are passed."""
        self.space.clear()
        self._stored_since_check += nbytes
        if self._stored_since_check >= self._check_every:
            self._stored_since_check = 0
            if self.space.over_limits() and (self._background is None or self._background.done()):
                self._background = asyncio.ensure_future(self.disk.run(self.evict))

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

    def current_hints(self, *, keep: bool = True) -> EvictionHints:
        """The node's eviction hints now (``keep``: with the prefetch jobs' leases)."""
        return EvictionHints(self.hints.kept_newer_than() if keep else None, self.hints.staged())

    def background(self) -> asyncio.Future | None:
        """The eviction running in the background, if any (for shutdown)."""
        return self._background

    # -- evicting -------------------------------------------------------------------------------------------
    def over_limits(self) -> bool:
        return self.space.over_limits()

    def flush_stats(self) -> None:
        """Access statistics into the index first, so that the order is current (and this process's scans)."""
        self.stats.flush(self.index, self.objects.take_access(), self.config.engine.hot_dir_half_life)
        self.publish_scans()

    def evict(self, *, force: bool = False, dataset: str | None = None, everything: bool = False,
              need: int = 0) -> int:
        """Evict in the policy's order until usage is under the low watermark and ``need`` more bytes fit
        (``force``: even when under the high watermark); ``dataset`` / ``everything``: all of it that no reader
        holds (staged bytes stay). Returns the bytes freed. Blocking."""
        self.flush_stats()
        c = self.config.cache
        target = min(int(self.capacity * c.low_watermark), self.capacity - need)
        floor = max(self.min_free * 1.1, self.min_free + need)
        total, _ = self.index.totals()
        _, free = self.files.disk_usage()
        if not (force or everything or dataset) and total <= self.capacity * c.high_watermark and free >= self.min_free:
            return 0
        freed = 0
        if not (everything or dataset):
            freed = self._evict_guests(target, floor)
            # The node's own data is not evicted for guests' sake (it would only be fetched from the origin
            # again): not when what is over the target is guest data readers hold right now, nor to go from the
            # high watermark down to the low one once evicting guests got usage under the high one.
            guests = self.index.guest_bytes()
            if guests and self.index.totals()[0] - guests <= target:
                return freed
            if freed and self._under(int(self.capacity * c.high_watermark) - need, floor):
                return freed
        candidates = [*(Candidate(okey, rec) for okey, rec in self.index.objects(dataset)),
                      *(Candidate(None, p) for p in self.index.packs(dataset))]
        hints = self.current_hints(keep=not (everything or dataset))
        if everything or dataset:
            return self._evict_down_to(self.policy.order(candidates, hints), None, floor)
        # What a scan kept since it began (its pinned part) goes only while usage is over the high watermark, the
        # line its admission keeps to: sweeping it down to the low one made the scan fetch that part from the
        # origin again within the same epoch.
        scans = self.scans()

        def pinned(v: Candidate) -> bool:
            scan = scans.get(v.record.dataset)
            return scan is not None and v.last_access >= scan.since

        high = min(int(self.capacity * c.high_watermark), self.capacity - need)
        freed += self._evict_down_to(self.policy.order([v for v in candidates if not pinned(v)], hints), target, floor)
        freed += self._evict_down_to(self.policy.order([v for v in candidates if pinned(v)], hints), high, floor)
        if freed:
            log.info("evicted %d bytes", freed)
        return freed

    def _evict_down_to(self, victims: list[Candidate], target: int | None, floor: float) -> int:
        """Evict ``victims`` in order until usage is at most ``target`` with ``floor`` bytes free (None: all of
        them that no reader holds); bytes freed."""
        freed = 0
        for victim in victims:
            if target is not None and self._under(target, floor):
                break
            try:
                freed += self._evict_one(victim.okey, victim.record)
            except CacheFullError as exc:  # not even the index's reserve let it commit
                log.error("eviction stopped: %s", exc)
                break
        return freed

    def _under(self, target: int, floor: float) -> bool:
        total, _ = self.index.totals()
        _, free = self.files.disk_usage()
        return total <= target and free >= floor

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
            if self._under(target, floor):
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

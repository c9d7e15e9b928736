"""Pending packs: small files fetched from the origin wait in memory, readable by this process, until their
dataset's pack is written (at ``cache.pack_size`` bytes, or one second after the last addition), crash-safely
(:class:`~cachefs.store.pack_store.PackStore`); only then does the index point the members at it. At most two packs'
worth of fetched bytes wait for the disk. What the disk has no room for (:class:`~cachefs.node.space.DiskSpace`) is
dropped: those files were served, they are just not cached.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from cachefs.base.errors import CacheFSError, CacheFullError
from cachefs.formats.pack_file import Member
from cachefs.index import Index
from cachefs.node.admission import Admission
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.read_stats import ReadStats
from cachefs.store.base import PackStore

__all__ = ["PendingPacks"]

log = logging.getLogger(__name__)

#: Seconds after the last addition before a pending pack is written even if it is not full.
FLUSH_DELAY = 1.0
#: What a pack adds to its members' bytes (Arrow's header, schema and footer), and per member (its path,
#: version, checksum, offsets and padding): an upper bound, for asking the disk for room before writing.
_PACK_OVERHEAD = 4096
_MEMBER_OVERHEAD = 40


def _member_bytes(m: Member) -> int:
    return len(m.data) + len(m.path) + len(m.version) + _MEMBER_OVERHEAD


def _pack_bytes(members: list[Member]) -> int:
    return _PACK_OVERHEAD + sum(_member_bytes(m) for m in members)


class PendingPacks:
    def __init__(self, pack_size: int, store: PackStore, index: Index, admission: Admission, stats: ReadStats,
                 disk: DiskJobs, on_dropped: Callable[[list[Member]], None] | None = None) -> None:
        self.pack_size, self.store, self.index, self.admission, self.disk = pack_size, store, index, admission, disk
        self.stats, self.space = stats, admission.space
        self._lock = threading.Lock()  # read from FUSE threads too
        # (dataset id, guest) → members of its next pack: guest data (other members own it) goes in packs of its
        # own, which are evicted first.
        self._pending: dict[tuple[str, bool], list[Member]] = {}
        self._pending_bytes: dict[tuple[str, bool], int] = {}
        self._pending_data: dict[bytes, bytes] = {}  # object key → bytes, until its pack is in the index
        self._unwritten = 0  # bytes pending or being written
        self._written: asyncio.Event | None = None
        self._writes: set[asyncio.Task] = set()
        self._flush_timer: asyncio.TimerHandle | None = None
        #: Set while pack writes fail for lack of space (cleared by the next one that succeeds).
        self.full_error: CacheFullError | None = None
        #: Called (on a disk thread) with the members the disk had no room for, while they are still readable.
        self.on_dropped = on_dropped

    @property
    def unwritten(self) -> int:
        """Bytes waiting for, or being written to, the disk."""
        return self._unwritten

    def get(self, okey: bytes) -> bytes | None:
        """A pending member's bytes (any thread)."""
        with self._lock:
            return self._pending_data.get(okey)

    async def add(self, ds_id: str, member: Member, *, guest: bool = False) -> None:
        """Queue ``member`` for its dataset's next pack (of guest data, with ``guest``), readable at once through
        :meth:`get`; waits while two packs' worth of bytes are waiting for the disk."""
        key = (ds_id, guest)
        with self._lock:
            self._pending_data[member.okey] = member.data
            self._pending.setdefault(key, []).append(member)
            pending = self._pending_bytes[key] = self._pending_bytes.get(key, 0) + len(member.data)
            self._unwritten += len(member.data)
            full = pending >= self.pack_size
        if full:
            self._start_write(key)
        elif self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(FLUSH_DELAY, self._flush_soon)
        # Back-pressure: at most two packs' worth of fetched bytes wait for the disk.
        while self._unwritten > 2 * self.pack_size:
            if self._written is None:
                self._written = asyncio.Event()
            self._written.clear()
            if not self._writes:
                for key in list(self._pending):
                    self._start_write(key)
            await self._written.wait()

    def _flush_soon(self) -> None:
        self._flush_timer = None
        for key in list(self._pending):
            self._start_write(key)

    def _take(self, key: tuple[str, bool]) -> list[Member]:
        with self._lock:
            self._pending_bytes.pop(key, None)
            return self._pending.pop(key, [])

    def _start_write(self, key: tuple[str, bool]) -> None:
        members = self._take(key)
        if not members:
            return
        task = asyncio.ensure_future(self.disk.run(self._write, key, members))
        self._writes.add(task)

        def done(t: asyncio.Task) -> None:
            self._writes.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("writing a pack failed: %s", t.exception())  # (its members are fetched again)
            elif not t.cancelled():
                self.admission.note_stored(t.result())
            if self._written is not None:
                self._written.set()

        task.add_done_callback(done)

    def _write(self, key: tuple[str, bool], members: list[Member]) -> int:
        """Write one pack and record its members (a disk thread); bytes written. What the disk has no room for
        is dropped: those members were served, they are just not cached."""
        nbytes = sum(len(m.data) for m in members)
        dropped: list[Member] = []
        try:
            written = self._write_fitting(key, members, dropped)
            if dropped and self.on_dropped is not None:
                self.on_dropped(dropped)
        finally:
            with self._lock:  # in the index now (or dropped): no longer served from memory
                for m in members:
                    self._pending_data.pop(m.okey, None)
                self._unwritten -= nbytes
        if key[1]:
            return written  # guest data the disk has no room for is no error: its owner keeps it
        if dropped:
            self.full_error = CacheFullError(f"cache disk full: could not store {len(dropped)} small files "
                                             f"(capacity {self.space.capacity} B)")
        else:
            self.full_error = None
        return written

    def _write_fitting(self, key: tuple[str, bool], members: list[Member], dropped: list[Member]) -> int:
        """Write as many of ``members`` (in order) as the disk has room for, as one pack; the rest go to
        ``dropped``. Room is asked for first (evicting once), so a full disk costs no failed writes."""
        space, guest, nbytes = self.space, key[1], _pack_bytes(members)
        room = self.admission.guest_room(nbytes) if guest else self.admission.room(key[0], nbytes)
        if room < nbytes:
            # What read-ahead brought and no reader has had yet goes first: dropping it costs a second fetch when
            # its reader comes; what readers already had only matters next epoch.
            unread = self.stats.unread_ahead
            members = sorted(members, key=lambda m: not unread(m.okey))
        fit, need = 0, _PACK_OVERHEAD
        for m in members:
            need += _member_bytes(m)
            if need > room:
                break
            fit += 1
        dropped.extend(members[fit:])
        if not fit:
            if not guest and not self.admission.scanning(key[0]):
                space.mark_full()
            return 0
        if guest:
            written = self.admission.store_guest(_pack_bytes(members[:fit]), lambda: self._write_pack(key, members[:fit]))
        else:
            written = self.admission.store(_pack_bytes(members[:fit]), lambda: self._write_pack(key, members[:fit]),
                                           dataset=key[0])
        if written is None:
            dropped.extend(members[:fit])
            return 0
        return written

    def _write_pack(self, key: tuple[str, bool], members: list[Member]) -> int:
        ds_id, guest = key
        written = self.store.write(ds_id, members)
        try:
            self.index.commit_pack(ds_id, written.pack_id, written.size, written.members, guest=guest)
        except CacheFSError:
            self.store.remove(ds_id, written.pack_id)  # never a pack file the index does not know
            raise
        return written.size

    async def flush(self) -> None:
        """Write every pending pack now and wait for all writes."""
        for key in list(self._pending):
            self._start_write(key)
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def flush_sync(self) -> None:
        """:meth:`flush` for callers without the event loop (shutdown)."""
        for key in list(self._pending):
            members = self._take(key)
            if members:
                self._write(key, members)

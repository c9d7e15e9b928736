"""Small files read from this node, from any thread: from a pending pack in memory, from a pack being assembled from
a mirror, from a published pack on disk, or (cluster.keep_guest off) from the guests a peer sent.

Reads verify the member's xxh3 every time (a member is at most ``pack_threshold`` bytes, so that is cheaper
than remembering what was verified); a mismatch drops the member from the index and it is fetched again.

Pack read-ahead: a member is read with exactly one ``pread`` (the device's read-ahead is off for packs), but a
pack that several reads hit within a few seconds is being swept (:func:`~cachefs.prefetch.planners.sweep`) and is
read into the page cache whole, so its other members cost no disk request each. Pack descriptors are kept open
(the last :data:`MAX_OPEN_PACKS`), so a read costs no open.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Literal

from cachefs.formats.pack_file import CORRUPT, WOULD_WAIT, MemberRead, read_member
from cachefs.index import Index
from cachefs.index.records import pack_key
from cachefs.node.bytes_lru import BytesLRU
from cachefs.node.pack_assembly import PackAssemblies
from cachefs.node.read_stats import ReadStats
from cachefs.prefetch.planners import sweep
from cachefs.read.pending_packs import PendingPacks
from cachefs.store.base import PackStore

__all__ = ["MAX_OPEN_PACKS", "SWEEP_READS", "SWEEP_WINDOW", "PackReads"]

log = logging.getLogger(__name__)

MAX_OPEN_PACKS = 256
#: A pack read this many times within SWEEP_WINDOW seconds is read ahead whole (see the module docstring).
SWEEP_READS = 3
SWEEP_WINDOW = 5.0
_READ_AHEAD_PIECE = 2 * 1024 * 1024


def _read_ahead(fd: int) -> None:
    """Read the whole file into the page cache, from a thread of its own (the kernel submits the reads before
    WILLNEED returns, and they can wait for the device's queue); closes ``fd``. One WILLNEED reads at most the
    device's read-ahead maximum, so the file is asked for in pieces."""
    def run() -> None:
        try:
            size = os.fstat(fd).st_size
            for start in range(0, size, _READ_AHEAD_PIECE):
                os.posix_fadvise(fd, start, _READ_AHEAD_PIECE, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    threading.Thread(target=run, name="cachefs-pack-readahead", daemon=True).start()


class PackReads:
    """Thread-safe: FUSE request threads read here while the event loop fetches and writes packs."""

    def __init__(self, store: PackStore, index: Index, pending: PendingPacks, assemblies: PackAssemblies,
                 stats: ReadStats, guests: BytesLRU, unread: BytesLRU) -> None:
        self.store, self.index, self.pending, self.assemblies, self.stats = store, index, pending, assemblies, stats
        #: Small files the group's peers sent and this node does not store (cluster.keep_guest off).
        self.guests = guests
        #: Small files read ahead that the disk had no room for, until their readers come.
        self.unread = unread
        self._lock = threading.Lock()
        self._fds: OrderedDict[bytes, int] = OrderedDict()  # pack key → descriptor
        self._sweeps: dict[bytes, tuple[float, int, float]] = {}  # pack key → sweep state (planners.sweep)

    def has(self, okey: bytes) -> bool:
        return (self.pending.get(okey) is not None or self.assemblies.holds(okey)
                or self.index.packed(okey) is not None or okey in self.guests or okey in self.unread)

    def local(self, ds_id: str, okey: bytes, size: int, *, wait: bool = True
              ) -> bytes | bytearray | Literal[MemberRead.WOULD_WAIT] | None:
        """The whole object if this node holds it (checksum verified), else None. Without ``wait``, WOULD_WAIT if
        reading it would wait on the disk (then call again with ``wait``)."""
        if size == 0:
            return b""
        data = self.pending.get(okey)
        if data is not None:
            return data
        if self.assemblies.holds(okey):  # in a pack being assembled here
            assembling = self.assemblies.read(okey, wait)
            if assembling is not None:
                return assembling
        loc = self.index.packed(okey)
        if loc is None:
            # (only on a miss here: packed files never pay for these locks)
            return self.guests.get(okey) or self.unread.get(okey)
        pack_id, offset, length, checksum = loc
        pkey = pack_key(ds_id, pack_id)
        fd = self._open_pack(ds_id, pack_id, pkey)
        if fd is None:  # the file is gone but the index still names it (removed behind our back)
            self.index.remove_pack(ds_id, pack_id, evicted=False)
            return None
        try:
            member = read_member(fd, offset, length, checksum, wait)
            if member is not WOULD_WAIT and member is not CORRUPT and self._read_counted(pkey):
                _read_ahead(os.dup(fd))
        finally:
            self._put_back(pkey, fd)
        if member is CORRUPT:
            self.stats.note_corrupt("small")
            log.warning("dataset %s: a small file (object key %s) failed its checksum in pack %016x on this node's "
                        "disk; dropped, fetched again", ds_id, okey.hex(), pack_id)
            self.index.drop_packed(ds_id, okey)
            return None
        return member

    def _read_counted(self, pkey: bytes) -> bool:
        """Count a read of pack ``pkey``; True when it is being swept (read it ahead now)."""
        self.stats.pack_read(pkey)
        with self._lock:
            if len(self._sweeps) >= 4 * MAX_OPEN_PACKS:
                now = time.monotonic()
                self._sweeps = {k: v for k, v in self._sweeps.items() if now - v[0] < SWEEP_WINDOW}
            self._sweeps[pkey], now_ahead = sweep(self._sweeps.get(pkey), time.monotonic(), SWEEP_READS, SWEEP_WINDOW)
        return now_ahead

    def _open_pack(self, ds_id: str, pack_id: int, pkey: bytes) -> int | None:
        with self._lock:
            fd = self._fds.pop(pkey, None)  # taken out while in use: nobody closes it under us
        # An evicted pack's descriptor still reads its (immutable, checksummed) members; close_unlinked lets
        # the space go.
        return fd if fd is not None else self.store.open(ds_id, pack_id)

    def _put_back(self, pkey: bytes, fd: int) -> None:
        with self._lock:
            old = self._fds.pop(pkey, None)
            self._fds[pkey] = fd
            excess = [self._fds.popitem(last=False)[1] for _ in range(len(self._fds) - MAX_OPEN_PACKS)]
        for stale in [old, *excess]:
            if stale is not None and stale != fd:
                os.close(stale)

    def close_all_packs(self) -> None:
        """Close every kept pack descriptor (the next read of each opens it again)."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
        for fd in fds:
            os.close(fd)

    def close_unlinked(self) -> int:
        """Close the kept descriptors of packs that were evicted (by any process), so their disk space is
        freed; returns how many. Called with the statistics flush."""
        with self._lock:
            gone = [k for k, fd in self._fds.items() if os.fstat(fd).st_nlink == 0]
            fds = [self._fds.pop(k) for k in gone]
        for fd in fds:
            os.close(fd)
        return len(fds)

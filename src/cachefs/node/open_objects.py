"""The cache files of large objects this process has open: one descriptor per object version, shared by every
reader, with the blocks known to be present, and the hold that keeps eviction away while a reader has the file
open (or a block is being written into it).

A descriptor is kept after its last use (up to :data:`MAX_OPEN` of them) so that the next read costs no open;
it holds nothing then. If some process evicts the object meanwhile, the handle goes *stale*: it still reads
every block it knew (the unlinked file keeps them), it takes no more writes, and it leaves the table, so that the
next user opens the object's new file.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from cachefs.base.errors import CacheFullError
from cachefs.base.types import Entry, object_key
from cachefs.index import Index
from cachefs.index.records import ObjectRecord
from cachefs.store import BlockStore, StoredObject

__all__ = ["MAX_OPEN", "OpenObject", "OpenObjects"]

#: Open object files kept per process; idle ones beyond this are closed.
MAX_OPEN = 1024


@dataclass(eq=False)
class OpenObject:
    stored: StoredObject
    record: ObjectRecord
    #: Blocks known present: index → (xxh3, length).
    present: dict[int, tuple[int, int]]
    nblocks: int = 0
    refs: int = 0  # operations under way
    #: Pins and block writes under way: while above zero the file is held (flock) against eviction.
    holds: int = 0
    #: Evicted under this handle: reads on (every block in ``present`` is whole in the unlinked file), takes no
    #: writes, is out of the table, and is closed once nobody uses it.
    stale: bool = False
    hits: int = 0  # accesses since the statistics last took them
    last_access: float = field(default_factory=time.time)
    #: Every block is present and verified through this handle, and none is waiting to count as read-ahead: a
    #: reader that holds it may read the file directly (BlockFile.read_local).
    whole: bool = False

    @property
    def key(self) -> bytes:
        return self.stored.key


class OpenObjects:
    """Thread-safe: FUSE request threads serve local reads from here while the event loop fetches."""

    def __init__(self, index: Index, store: BlockStore, block_size: int) -> None:
        self.index, self.store, self.block_size = index, store, block_size
        self._open: OrderedDict[bytes, OpenObject] = OrderedDict()
        self._lock = threading.RLock()
        self._access: dict[bytes, tuple[float, int]] = {}  # of objects closed since the last take_access

    # -- use ------------------------------------------------------------------------------------------------
    def acquire(self, ds_id: str, entry: Entry, okey: bytes | None = None) -> OpenObject:
        """``entry``'s open object (opened now if need be), in use until :meth:`release`; ``okey``: its object key,
        when the caller has it (it is a hash)."""
        okey = okey or object_key(ds_id, entry.path, entry.version)
        with self._lock:
            ob = self._open.get(okey)
            if ob is None:
                stored = self.store.open(okey, ds_id, entry.size)
                rec = ObjectRecord(ds_id, entry.path, entry.version, entry.size, block_size=self.block_size)
                ob = OpenObject(stored, rec, self.index.blocks_of(okey), nblocks=-(-entry.size // self.block_size))
                self._open[okey] = ob
                self._trim()
            else:
                self._open.move_to_end(okey)
            ob.refs += 1
            return ob

    @contextlib.contextmanager
    def using(self, ds_id: str, entry: Entry, okey: bytes | None = None) -> Iterator[OpenObject]:
        """:meth:`acquire` for the ``with`` block, :meth:`release` after it."""
        ob = self.acquire(ds_id, entry, okey)
        try:
            yield ob
        finally:
            self.release(ob)

    def retain(self, ob: OpenObject) -> None:
        """One more user of ``ob`` (a background fetch into it); :meth:`release` when done."""
        with self._lock:
            ob.refs += 1

    def release(self, ob: OpenObject) -> None:
        with self._lock:
            ob.refs -= 1
            if ob.stale and ob.refs <= 0 and ob.holds <= 0:
                ob.stored.close()

    def get(self, okey: bytes) -> OpenObject | None:
        with self._lock:
            return self._open.get(okey)

    def has(self, ob: OpenObject, idx: int) -> bool:
        """Whether block ``idx`` is present (asking the index if this process has not seen it: another may have
        fetched it)."""
        if idx in ob.present:
            return True
        got = self.index.block(ob.key, idx)
        if got is not None:
            if not ob.stored.linked():  # recorded into the object's new file, not into this evicted one
                with self._lock:
                    self._mark_stale(ob)
                return False
            ob.present[idx] = got
            return True
        return False

    def write_block(self, ob: OpenObject, idx: int, data: bytes | bytearray, checksum: int, *, guest: bool) -> bool:
        """Write block ``idx`` into ``ob``'s file and record it in the index (a disk thread runs this, once the
        disk has room); False if the file was evicted meanwhile (its next reader opens the new one). CacheFullError
        when the index cannot take the record: the block's space is given back."""
        if not self.hold(ob):
            return False
        try:
            ob.stored.write_block(idx, data)
            try:
                self.index.put_block(ob.key, idx, checksum, len(data), ob.record, guest=guest)
            except CacheFullError:
                ob.stored.drop_block(idx)
                raise
        finally:
            self.unhold(ob)
        return True

    def note_present(self, ob: OpenObject, idx: int, checksum: int, length: int) -> None:
        """Block ``idx`` is recorded: this process reads it from ``ob``'s file from now on."""
        ob.present[idx] = (checksum, length)

    def drop_corrupt(self, ob: OpenObject, idx: int) -> None:
        """Block ``idx`` failed its checksum: forget it here and in the index, so that it is fetched again."""
        ob.present.pop(idx, None)
        ob.whole = False
        ob.stored.forget_verified(idx)
        if ob.stored.linked():  # (an evicted file's record is gone already, or names another file's block)
            self.index.drop_block(ob.key, idx)

    def complete(self, ob: OpenObject) -> bool:
        return all(self.has(ob, i) for i in range(ob.nblocks)) and not ob.stale and ob.stored.linked()

    # -- holds ----------------------------------------------------------------------------------------------
    def hold(self, ob: OpenObject) -> bool:
        """Hold ``ob``'s file against eviction by any process; False if it was evicted (``ob`` is stale then)."""
        with self._lock:
            if ob.stale:
                return False
            if ob.holds == 0 and not ob.stored.hold():
                self._mark_stale(ob)
                return False
            ob.holds += 1
            return True

    def unhold(self, ob: OpenObject) -> None:
        with self._lock:
            ob.holds -= 1
            if ob.holds == 0:
                if ob.stale:
                    if ob.refs <= 0:
                        ob.stored.close()
                else:
                    ob.stored.unhold()

    def pin(self, ds_id: str, entry: Entry) -> OpenObject | None:
        """Acquire and hold ``entry``'s file (a reader opened it); None if it keeps being evicted under us."""
        for _ in range(3):
            ob = self.acquire(ds_id, entry)
            if self.hold(ob):
                return ob
            self.release(ob)  # evicted while idle here: the next acquire opens its new file
        return None

    def unpin(self, ob: OpenObject) -> None:
        self.unhold(ob)
        self.release(ob)

    def _mark_stale(self, ob: OpenObject) -> None:
        """Call with the lock held."""
        if ob.stale:
            return
        ob.stale = True
        if self._open.get(ob.key) is ob:
            del self._open[ob.key]
            self._note_access(ob)
        if ob.refs <= 0 and ob.holds <= 0:
            ob.stored.close()

    # -- closing --------------------------------------------------------------------------------------------
    def _trim(self) -> None:
        excess = len(self._open) - MAX_OPEN
        if excess <= 0:
            return
        # The least recently used are at the front; look a little past the excess in case some are busy.
        for okey in list(itertools.islice(self._open, excess + 32)):
            if len(self._open) <= MAX_OPEN:
                break
            ob = self._open[okey]
            if ob.refs == 0:
                self._close(ob)

    def _close(self, ob: OpenObject) -> None:
        del self._open[ob.key]
        self._note_access(ob)
        ob.stored.close()
        if not ob.present:  # opened but never filled: do not leave an empty file the index does not know
            okey = ob.key
            self.store.try_remove(okey, ob.record.dataset, lambda: self.index.object(okey) is None)

    def close_idle(self, okey: bytes) -> bool:
        """Close ``okey``'s descriptor if nobody uses or holds it (an evictor in this process is about to take
        the file); False if a reader holds it."""
        with self._lock:
            ob = self._open.get(okey)
            if ob is None:
                return True
            if ob.holds > 0:
                return False
            if ob.refs == 0:
                self._close(ob)
            return True  # a read under way reads on from the unlinked file and lets it go after

    def close_evicted(self) -> int:
        """Close the idle descriptors of objects some process evicted (their space comes back); how many."""
        with self._lock:
            gone = [ob for ob in self._open.values() if ob.refs == 0 and not ob.stored.linked()]
            for ob in gone:
                self._close(ob)
        return len(gone)

    def close_all(self) -> None:
        with self._lock:
            for ob in self._open.values():
                self._note_access(ob)
                ob.stored.close()
            self._open.clear()

    # -- access statistics ----------------------------------------------------------------------------------
    def _note_access(self, ob: OpenObject) -> None:
        if ob.hits:
            last, hits = self._access.get(ob.key, (0.0, 0))
            self._access[ob.key] = (max(last, ob.last_access), hits + ob.hits)
            ob.hits = 0

    def take_access(self) -> dict[bytes, tuple[float, int]]:
        """(last access, accesses) per object since the last call, for the index."""
        with self._lock:
            for ob in self._open.values():
                self._note_access(ob)
            taken, self._access = self._access, {}
        return taken

"""The inodes the kernel holds for one mount, on the cache disk.

The kernel keeps a reference to every inode a LOOKUP or READDIRPLUS answered until it sends FORGET, and after a
walk of a dataset that is every file in it: kept in the daemon's memory, that state grew by about 1 KB a file (a
14 M-file dataset wanted 14 GB). Here each inode is one LMDB record: its number → lookup count, the daemon
generation that first handed it out, whether it was opened since, the object version the kernel was shown (for
inodes handed out while the dataset's first listing ran) and its path. Memory stays flat (LMDB's pages are the
page cache's, given back under pressure), and a restarted daemon, or the next node pod's, finds the same records
(committed transactions survive ``kill -9``; only a machine crash loses them, and that loses the mount too).

Numbers come from a hash of the path (:func:`path_ino`), so a path keeps its number across forgets and daemon
restarts; a collision moves it to the next free number. A forgotten record with a record right after it stays
as a tombstone (no lookups), so that finding the later one still probes past it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from collections.abc import Iterable
from typing import NamedTuple

import lmdb

from cachefs.base.errors import CacheFSError

log = logging.getLogger("cachefs.fuse")

__all__ = ["ROOT", "InodeRecord", "InodeTable", "path_ino"]

ROOT = 1
#: Address space reserved for the table: about 60 bytes a record, so 10^9 inodes (LMDB grows the file as written).
_MAP_SIZE = 1 << 36
_HEAD = struct.Struct("<IIBH")  # lookups, generation, flags, length of the version
_OPENED = 1
_KEY = struct.Struct(">Q")


def path_ino(path: str) -> int:
    """The inode number a path asks for (a collision moves it to the next free number)."""
    h = int.from_bytes(hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "little")
    return max(h >> 1, ROOT + 1)


class InodeRecord(NamedTuple):
    path: str
    lookups: int
    generation: int  # the daemon generation that handed it out (lookups since included)
    opened: bool  # opened since it was handed out
    version: str  # the version the kernel was shown, where a later manifest may name another ("" otherwise)


def _pack(r: InodeRecord) -> bytes:
    version = r.version.encode()
    return _HEAD.pack(r.lookups, r.generation, _OPENED if r.opened else 0, len(version)) + version + \
        r.path.encode("utf-8", "surrogateescape")


def _unpack(raw: bytes | memoryview) -> InodeRecord:
    lookups, generation, flags, vlen = _HEAD.unpack_from(raw)
    at = _HEAD.size
    version = bytes(raw[at:at + vlen]).decode()
    path = bytes(raw[at + vlen:]).decode("utf-8", "surrogateescape")
    return InodeRecord(path, lookups, generation, bool(flags & _OPENED), version)


class InodeTable:
    """The kernel's inodes of one mount at ``path`` (an LMDB file and its ``-lock``). ``generation``: this daemon's;
    ``fresh``: a new mount (what the file held is dropped). Not thread-safe: the caller serialises.

    A disk with no room left for a record (the cache disk full) does not fail a lookup: the table goes on in memory
    for what changes from then on (``degraded``; a daemon restarted later may not know those inodes, and requests
    naming one get ESTALE), as the mount journal does."""

    def __init__(self, path: str, *, generation: int = 0, fresh: bool = True) -> None:
        self.path, self.generation = path, generation
        self.degraded = False
        self._overlay: dict[int, InodeRecord | None] = {}  # changes kept in memory once degraded
        if fresh:
            self.remove(path)
        try:
            os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
            # sync off: a kill -9 loses nothing (committed pages are in the page cache), as for the mount journal.
            self._env: lmdb.Environment | None = lmdb.open(
                path, subdir=False, map_size=_MAP_SIZE, max_dbs=0, sync=False, metasync=False, readahead=False,
                meminit=False, lock=True, mode=0o600)
        except lmdb.Error as exc:
            if not fresh:  # (what a previous daemon wrote is there and cannot be read)
                raise CacheFSError(f"cannot open the mount's inode table {path}: {exc}") from None
            self._env = None
            self._degrade(exc)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()

    @staticmethod
    def remove(path: str) -> None:
        """Delete the table at ``path`` (its mount is gone)."""
        for p in (path, path + "-lock"):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def __len__(self) -> int:
        """How many records (the rare tombstone of a collision counted too)."""
        n = 0 if self._env is None else self._env.stat()["entries"]
        with self._reading() as txn:
            for ino, r in self._overlay.items():
                n += (r is not None) - (txn is not None and txn.get(_KEY.pack(ino)) is not None)
        return n

    def get(self, ino: int) -> InodeRecord | None:
        with self._reading() as txn:
            r = self._record(txn, {}, ino)
        return None if r is None or r.lookups == 0 else r

    def looked_up(self, items: list[tuple[str, str]]) -> list[tuple[int, InodeRecord]]:
        """The kernel was handed these (path, version shown) once more each: their numbers and records, the count
        raised (a new record where there was none), in one transaction."""
        if not self.degraded and self._env is not None:
            try:
                return self._looked_up_on_disk(items)
            except lmdb.Error as exc:  # (the disk or the map full: nothing of the transaction was written)
                self._degrade(exc)
        out: list[tuple[int, InodeRecord]] = []
        changes: dict[int, InodeRecord | None] = {}
        with self._reading() as txn:
            for path, version in items:
                ino, r = self._find(txn, changes, path)
                r = self._bumped(r, path, version)
                changes[ino] = r
                out.append((ino, r))
        self._apply(changes)
        return out

    def _looked_up_on_disk(self, items: list[tuple[str, str]]) -> list[tuple[int, InodeRecord]]:
        """:meth:`looked_up` in one write transaction that reads its own writes (a walk's hot path)."""
        out = []
        assert self._env is not None
        with self._env.begin(write=True, buffers=True) as txn:  # (its reads see its own writes)
            for path, version in items:
                ino, r = self._find(txn, {}, path)
                r = self._bumped(r, path, version)
                txn.put(_KEY.pack(ino), _pack(r))
                out.append((ino, r))
        return out

    def _bumped(self, r: InodeRecord | None, path: str, version: str) -> InodeRecord:
        """``r`` looked up once more; a new record where there is none. (One the kernel holds keeps the version it
        was shown first: its pages are of that one.)"""
        if r is None or r.lookups == 0:
            return InodeRecord(path, 1, self.generation, False, version)
        return r._replace(lookups=r.lookups + 1)

    def opened(self, ino: int) -> None:
        """Mark ``ino`` opened (its page cache may hold pages from now on)."""
        r = self.get(ino)
        if r is not None and not r.opened:
            self._apply({ino: r._replace(opened=True)})

    def forget(self, items: Iterable[tuple[int, int]]) -> list[int]:
        """The kernel dropped ``nlookup`` references to each (ino, nlookup); the numbers it holds no more (their
        records gone), in one transaction. A count the kernel takes below zero (lookups made by a daemon whose
        records were lost) ends the record too."""
        changes: dict[int, InodeRecord | None] = {}
        with self._reading() as txn:
            for ino, nlookup in items:
                r = self._record(txn, changes, ino)
                if r is None or r.lookups == 0:
                    continue
                if r.lookups > nlookup:
                    changes[ino] = r._replace(lookups=r.lookups - nlookup)
                elif self._record(txn, changes, ino + 1) is not None:  # (a probe for that one passes here)
                    changes[ino] = r._replace(lookups=0)
                else:
                    changes[ino] = None
        self._apply(changes)
        return [ino for ino, r in changes.items() if r is None or r.lookups == 0]

    def adopt(self, inodes: dict[int, str], versions: dict[int, str]) -> None:
        """Take records from a previous daemon's journal (a release that kept inodes there): one lookup each."""
        self._apply({ino: InodeRecord(path, 1, max(self.generation - 1, 0), True, versions.get(ino, ""))
                     for ino, path in inodes.items()})

    # -- records ------------------------------------------------------------------------------------------------
    def _reading(self) -> contextlib.AbstractContextManager[lmdb.Transaction | None]:
        return contextlib.nullcontext() if self._env is None else self._env.begin(buffers=True)

    def _record(self, txn: lmdb.Transaction | None, changes: dict[int, InodeRecord | None], ino: int) -> InodeRecord | None:
        for pending in (changes, self._overlay):
            if ino in pending:
                return pending[ino]
        raw = None if txn is None else txn.get(_KEY.pack(ino))
        return None if raw is None else _unpack(raw)

    def _find(self, txn: lmdb.Transaction | None, changes: dict[int, InodeRecord | None],
              path: str) -> tuple[int, InodeRecord | None]:
        if path == "":
            return ROOT, None
        ino = path_ino(path)
        while True:
            r = self._record(txn, changes, ino)
            if r is None or r.path == path:
                return ino, r
            ino += 1

    def _apply(self, changes: dict[int, InodeRecord | None]) -> None:
        if not self.degraded and self._env is not None:
            try:
                with self._env.begin(write=True) as txn:
                    for ino, r in changes.items():
                        if r is None:
                            txn.delete(_KEY.pack(ino))
                        else:
                            txn.put(_KEY.pack(ino), _pack(r))
                return
            except lmdb.Error as exc:  # (the disk or the map full: nothing of this transaction was written)
                self._degrade(exc)
        self._overlay.update(changes)

    def _degrade(self, exc: Exception) -> None:
        self.degraded = True
        log.error("inode table %s: %s; keeping what changes in memory from now on (a restarted daemon may not "
                  "know those inodes)", self.path, exc)

"""Frozen dataset manifests stored in the node index.

A manifest version is an immutable snapshot of a dataset's tree: every directory and file with its size,
origin version (ETag) and mtime. Entries are keyed ``dataset id | version (u32 BE) | parent dir | NUL | name``
so that ``listdir`` is one ordered range scan over exactly the directory's children (a 1M-entry directory
lists in about a second) and ``stat`` is one B-tree lookup. Nothing is loaded into memory up front, so many
processes can open a multi-million-entry manifest at once.
"""

from __future__ import annotations

import functools
import itertools
import struct
import time
from collections.abc import Callable, Iterable, Iterator

from cachefs.base.errors import ObjectNotFoundError
from cachefs.base.types import Entry
from cachefs.index import Index

__all__ = ["ManifestStore", "ManifestWriter", "valid_relpath", "walk_files"]

_ENTRY = struct.Struct("<BQd")
_FILE, _DIR = 0, 1
_NAME_MAX = 255


def _prefix(ds_id: str, version: int) -> bytes:
    return ds_id.encode() + version.to_bytes(4, "big")


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent, name


def _key(ds_id: str, version: int, path: str) -> bytes:
    parent, name = _split(path)
    return _prefix(ds_id, version) + parent.encode() + b"\0" + name.encode()


def _pack(e: Entry) -> bytes:
    return _ENTRY.pack(_DIR if e.is_dir else _FILE, e.size, e.mtime) + e.version.encode()


def _unpack(path: str, raw) -> Entry:
    kind, size, mtime = _ENTRY.unpack_from(raw)
    return Entry(path, size, bytes(raw[_ENTRY.size:]).decode(), mtime, kind == _DIR)


def valid_relpath(path: str) -> str | None:
    """Why ``path`` cannot appear in a POSIX tree, or None when it can."""
    if not path:
        return "empty name"
    if "\0" in path:
        return "NUL in name"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return f"path component {part!r}"
        if len(part.encode()) > _NAME_MAX:
            return "name longer than 255 bytes"
    return None


def walk_files(listdir: Callable[[str], Iterable[Entry]], path: str = "") -> Iterator[Entry]:
    """Every file under ``path`` of the tree ``listdir(directory)`` lists, depth first, in name order."""
    stack = [path]
    while stack:
        d = stack.pop()
        subdirs = []
        for e in listdir(d):
            if e.is_dir:
                subdirs.append(e.path)
            else:
                yield e
        stack.extend(reversed(subdirs))


class ManifestStore:
    """Read access to the manifests of all datasets on the node."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self._env = index.env
        self._db = index.manifest_db

    def lookup(self, ds_id: str, version: int, path: str) -> Entry:
        """The entry at ``path`` ("" is the root directory); raises ObjectNotFoundError."""
        if path == "":
            return Entry("", 0, "", 0.0, True)
        with self._env.begin(buffers=True) as txn:
            raw = txn.get(_key(ds_id, version, path), db=self._db)
            if raw is None:
                raise ObjectNotFoundError(f"{path}: no such file or directory in the dataset manifest")
            return _unpack(path, raw)

    def listdir(self, ds_id: str, version: int, path: str) -> Iterator[Entry]:
        """Entries of directory ``path`` in name order; raises ObjectNotFoundError / NotADirectoryError."""
        if path and not self.lookup(ds_id, version, path).is_dir:
            raise NotADirectoryError(20, f"{path}: not a directory")
        return self._children(ds_id, version, path, None, None)

    def listdir_page(self, ds_id: str, version: int, path: str, after: str | None, limit: int) -> list[Entry]:
        """At most ``limit`` entries of directory ``path`` whose names sort after ``after`` (None: from the first),
        in name order: a directory read page by page is never held whole. Raises as :meth:`listdir`."""
        if path and not self.lookup(ds_id, version, path).is_dir:
            raise NotADirectoryError(20, f"{path}: not a directory")
        return list(self._children(ds_id, version, path, after, limit))

    def _children(self, ds_id: str, version: int, path: str, after: str | None, limit: int | None) -> Iterator[Entry]:
        start = _prefix(ds_id, version) + path.encode() + b"\0"
        base = path + "/" if path else ""
        with self._env.begin(buffers=True) as txn:
            cur = txn.cursor(db=self._db)
            # (names hold no NUL: the first key past ``after`` and every name it begins is at or past after + NUL)
            if not cur.set_range(start if after is None else start + after.encode() + b"\0"):
                return
            n = len(start)
            for k, v in itertools.islice(cur, limit):
                if bytes(k[:n]) != start:
                    break
                yield _unpack(base + bytes(k[n:]).decode(), v)

    def walk_files(self, ds_id: str, version: int, path: str = "") -> Iterator[Entry]:
        """Every file under ``path``, depth first, in name order."""
        return walk_files(functools.partial(self.listdir, ds_id, version), path)

    def versions(self, ds_id: str) -> list[int]:
        """The manifest versions of ``ds_id`` that have entries in the index (committed, half-written or
        provisional), one cursor seek per version."""
        start = ds_id.encode()
        found = []
        with self._env.begin(buffers=True) as txn:
            cur = txn.cursor(db=self._db)
            key = start
            while cur.set_range(key):
                k = bytes(cur.key())
                if not k.startswith(start) or len(k) < len(start) + 4:
                    break
                version = int.from_bytes(k[len(start):len(start) + 4], "big")
                found.append(version)
                if version == 0xFFFF_FFFF:
                    break
                key = _prefix(ds_id, version + 1)
        return found

    def drop(self, ds_id: str, version: int) -> None:
        """Delete every entry of one manifest version (also used to clear a half-written one)."""
        pfx = _prefix(ds_id, version)
        def batch(txn) -> int:
            cur = txn.cursor(db=self._db)
            n = 0
            if cur.set_range(pfx):
                while cur.key()[: len(pfx)] == pfx and n < 50_000:
                    if not cur.delete():
                        break
                    n += 1
            return n

        # In bounded transactions, so a huge manifest does not hold the writer lock for long.
        while self._index.write_txn(batch) >= 50_000:
            pass


class ManifestWriter:
    """Writes one new manifest version batch by batch; files whose names POSIX cannot hold are skipped. With
    ``resumed`` the version holds what an interrupted listing wrote: a file listed again replaces its entry, and
    the totals are counted once the listing is done (:meth:`recount`)."""

    def __init__(self, index: Index, ds_id: str, version: int, *, resumed: bool = False) -> None:
        self._index, self._db = index, index.manifest_db
        self.ds_id, self.version, self.resumed = ds_id, version, resumed
        self.created = time.time()
        self.files = 0
        self.bytes = 0
        self.largest = 0  # an upper bound: a file later shadowed by a directory still counts
        self.skipped = 0
        #: The first few skipped paths and why, for the log and ``cachefs status``.
        self.skipped_examples: list[tuple[str, str]] = []
        self._dirs: set[str] = {""}
        self._new_dirs: list[str] = []  # added by the batch being written

    def add(self, batch: list[Entry]) -> None:
        before = (self.files, self.bytes, self.largest, self.skipped, len(self.skipped_examples))

        def undo() -> None:
            self.files, self.bytes, self.largest, self.skipped, n_examples = before
            del self.skipped_examples[n_examples:]
            self._dirs.difference_update(self._new_dirs)
            self._new_dirs.clear()

        def body(txn) -> None:
            # Every attempt starts from the state before the batch: a commit retried on a full disk (see
            # Index.write_txn) counts nothing twice.
            undo()
            self._add_batch(txn, batch)

        try:
            self._index.write_txn(body)
        except BaseException:
            undo()
            raise
        self._new_dirs.clear()

    def _add_batch(self, txn, batch: list[Entry]) -> None:
        for e in batch:
            path = e.path
            if path.endswith("/") and e.size == 0 and valid_relpath(path.rstrip("/")) is None:
                self._add_dir(txn, path.rstrip("/"))  # an S3 "directory marker" object
                continue
            why = valid_relpath(path)
            if why:
                self._skip(path, why)
                continue
            self._add_dir(txn, _split(path)[0])
            if path in self._dirs:
                self._skip(path, "a directory of the same name exists")
                continue
            key = _key(self.ds_id, self.version, path)
            if not txn.put(key, _pack(e), db=self._db, overwrite=False):
                if self.resumed:  # (written before the listing was interrupted: counted by recount)
                    txn.put(key, _pack(e), db=self._db)
                else:
                    self._skip(path, "listed twice")
                continue
            self.files += 1
            self.bytes += e.size
            self.largest = max(self.largest, e.size)

    def recount(self) -> None:
        """Count the files, bytes and largest file the version holds (a resumed listing: some were written before)."""
        pfx = _prefix(self.ds_id, self.version)
        files = nbytes = largest = 0
        with self._index.env.begin(buffers=True) as txn:
            cur = txn.cursor(db=self._db)
            if cur.set_range(pfx):
                for k, v in cur:
                    if bytes(k[:len(pfx)]) != pfx:
                        break
                    kind, size, _ = _ENTRY.unpack_from(v)
                    if kind == _FILE:
                        files, nbytes, largest = files + 1, nbytes + size, max(largest, size)
        self.files, self.bytes, self.largest = files, nbytes, largest

    def _add_dir(self, txn, path: str) -> None:
        while path not in self._dirs:
            key = _key(self.ds_id, self.version, path)
            old = txn.get(key, db=self._db)
            if old is not None:
                shadowed = _unpack(path, old)
                if not shadowed.is_dir:  # a file named like a directory: the directory wins
                    self.files -= 1
                    self.bytes -= shadowed.size
                    self._skip(path, "a directory of the same name exists")
            txn.put(key, _pack(Entry(path, 0, "", self.created, True)), db=self._db)
            self._dirs.add(path)
            self._new_dirs.append(path)
            path = _split(path)[0]

    def _skip(self, path: str, why: str) -> None:
        self.skipped += 1
        if len(self.skipped_examples) < 20:
            self.skipped_examples.append((path, why))

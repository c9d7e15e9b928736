"""A read-only file of one manifest entry, and the sync read of a range that files and ``cat`` share."""

from __future__ import annotations

import io
from typing import Any, Protocol

from cachefs.base.aio import run_sync
from cachefs.base.types import Entry
from cachefs.engine import WOULD_WAIT, Dataset, Engine, ReadStream

__all__ = ["CacheFile", "norm_range", "read_range"]


class FileOwner(Protocol):
    """What a :class:`CacheFile` needs of its filesystem (the ``CacheFileSystem``)."""

    @property
    def engine(self) -> Engine: ...

    def _info(self, ds: Dataset, e: Entry) -> dict[str, Any]: ...


def norm_range(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    """fsspec's ``start``/``end`` (None, negative from the end) as a range within ``size`` bytes."""
    start = 0 if start is None else (max(0, size + start) if start < 0 else start)
    end = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
    return start, max(start, end)


def read_range(engine: Engine, ds: Dataset, entry: Entry, start: int, end: int,
               stream: ReadStream | None = None) -> bytes | bytearray:
    """Sync read: local blocks from this thread, misses through the engine's loop."""
    data = engine.read_local(ds, entry, start, end, stream)
    if data is None or data is WOULD_WAIT:  # (a read that may wait never answers WOULD_WAIT)
        return run_sync(engine.read(ds, entry, start, end, stream))
    return data


class CacheFile(io.RawIOBase):
    """A read-only, seekable file of one manifest entry."""

    def __init__(self, fs: FileOwner, ds: Dataset, entry: Entry) -> None:
        super().__init__()
        self.fs, self.ds, self.entry = fs, ds, entry
        self.path = ds.ref.object_url(entry.path)
        self.size = entry.size
        self.mode = "rb"
        self._pos = 0
        self._file = fs.engine.open(ds, entry)  # eviction skips the object while this file is open

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self.size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError("negative seek position")
        self._pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        end = self.size if size is None or size < 0 else min(self.size, self._pos + size)
        if self._pos >= end:
            return b""
        got = self._file.read_local(self._pos, end)
        data = run_sync(self._file.read(self._pos, end)) if got is None or got is WOULD_WAIT else got
        out = data if isinstance(data, bytes) else bytes(data)  # (file-like readers expect bytes)
        self._pos += len(out)
        return out

    read1 = read

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer) -> int:
        data = self.read(len(memoryview(buffer)))
        n = len(data)
        memoryview(buffer).cast("B")[:n] = data
        return n

    def info(self) -> dict[str, Any]:
        return self.fs._info(self.ds, self.entry)

    def __repr__(self) -> str:
        return f"<CacheFile {self.path}>"

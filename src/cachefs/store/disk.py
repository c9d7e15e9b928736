"""The NVMe tier: sparse object files under ``<cache_dir>/data``.

Layout (format 1, docs/FORMAT.md): ``data/<dataset id>/<key[0:2] hex>/<key hex>``, where ``key`` is the
16-byte object key of (dataset, path, version). The file has the object's size from creation (sparse), and
block ``i`` lives at offset ``i × block_size``. Files are 0600 in 0700 directories.

Crash safety comes from ordering plus checksums rather than from temp files: a block's bytes are written
(``pwrite``) before the index records the block, so a crash before the record means the block is simply
fetched again, and a torn write can never be served because every block is verified against the xxh3
recorded with it. (Temp-file-and-rename per block would break the one-file-per-object layout that FUSE
passthrough needs.)

Eviction safety comes from ``flock``: a shared lock on the file is held while a reader has the object open
(a file open through the mount or fsspec) and while a block is written and recorded; an evictor takes the
exclusive lock without waiting, and skips the file if it cannot. A descriptor kept open with no lock (a
process's cache of open files) does not stop eviction: the file it reads is then unlinked but still whole for
every block it knew, which :meth:`DiskObject.hold` and :meth:`DiskObject.linked` tell, so its owner stops
writing to it and lets it go.
"""

from __future__ import annotations

import errno
import fcntl
import os

from cachefs.base.checksum import block_hasher
from cachefs.base.errors import CacheFSError, CacheFullError, CorruptBlockError
from cachefs.base.fallocate import punch_hole
from cachefs.store.base import BlockStore, StoredObject

__all__ = ["PIECE", "DiskObject", "DiskStore"]

#: Blocks are read and verified in pieces of this size (see DiskObject.read).
PIECE = _VERIFY_PIECE = 1024 * 1024


def _disk_error(exc: OSError, what: str) -> CacheFSError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheFullError(f"cache disk full while writing {what}")
    return CacheFSError(f"cache disk error on {what}: {exc.strerror}", errno_=exc.errno or errno.EIO)


class DiskObject(StoredObject):
    __slots__ = ("_bs", "_fd", "_verified", "key", "path", "size")

    def __init__(self, key: bytes, size: int, path: str, fd: int, block_size: int) -> None:
        self.key, self.size, self.path = key, size, path
        self._fd, self._bs = fd, block_size
        self._verified: set[int] = set()

    def write_block(self, idx: int, data: bytes | bytearray) -> None:
        try:
            n = os.pwrite(self._fd, data, idx * self._bs)
        except OSError as exc:
            raise _disk_error(exc, self.path) from None
        if n != len(data):  # only a full disk makes pwrite on a regular file short
            raise CacheFullError(f"cache disk full while writing {self.path}")

    def read(self, start: int, end: int, checksums: dict[int, tuple[int, int]]) -> bytes:
        bs = self._bs
        first, last = start // bs, (end - 1) // bs
        unverified = [i for i in range(first, last + 1) if i not in self._verified]
        if not unverified:
            return os.pread(self._fd, end - start, start)
        # Verify block by block in pieces below glibc's (pinned) mmap threshold: a block-sized buffer would be
        # a fresh mmap per read, every page of it faulted in, zeroed and unmapped again, which cost more than
        # the disk read itself. The pieces that overlap the range asked for are the answer.
        parts: list[bytes] = []
        for i in range(first, last + 1):
            lo = i * bs
            hi = min(self.size, lo + bs)
            if i not in self._verified:
                self._verify(i, lo, hi, checksums[i], start, end, parts)
            else:
                parts.append(os.pread(self._fd, min(end, hi) - max(start, lo), max(start, lo)))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _verify(self, idx: int, lo: int, hi: int, expected: tuple[int, int], start: int, end: int,
                parts: list[bytes]) -> None:
        checksum, length = expected
        hasher = block_hasher()
        got = 0
        for off in range(lo, hi, _VERIFY_PIECE):
            piece = os.pread(self._fd, min(_VERIFY_PIECE, hi - off), off)
            hasher.update(piece)
            got += len(piece)
            a, b = max(start, off), min(end, off + len(piece))
            if a < b:
                parts.append(piece if (a, b) == (off, off + len(piece)) else piece[a - off : b - off])
        if got != length or hasher.intdigest() != checksum:
            err = CorruptBlockError(f"{self.path}: block {idx} failed its checksum")
            err.block = idx
            raise err
        self._verified.add(idx)

    def verified(self, idx: int) -> bool:
        return idx in self._verified

    def all_verified(self, nblocks: int) -> bool:
        return len(self._verified) >= nblocks

    def read_verified(self, start: int, end: int) -> bytes:
        """``[start, end)`` of blocks this handle verified already (the caller knows they are)."""
        return os.pread(self._fd, end - start, start)

    def read_block(self, idx: int, expected: tuple[int, int]) -> list[bytes]:
        """Block ``idx`` whole, verified, as the pieces it was read in (:data:`PIECE` bytes each, the last
        shorter): a reader moving through the block slices its next reads from them instead of reading the
        block again."""
        lo = idx * self._bs
        hi = min(self.size, lo + self._bs)
        parts: list[bytes] = []
        self._verify(idx, lo, hi, expected, lo, hi, parts)
        return parts

    def forget_verified(self, idx: int) -> None:
        self._verified.discard(idx)

    def drop_block(self, idx: int) -> None:
        """Give a block's disk space back (it was written but could not be recorded)."""
        lo = idx * self._bs
        punch_hole(self._fd, lo, min(self._bs, self.size - lo))  # (without support: freed when evicted)

    def hold(self) -> bool:
        """Take the shared lock (waits while an evictor removes the file); False, with no lock held, if the
        file was evicted (unlinked) already."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        if self.linked():
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def unhold(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def fileno(self) -> int:
        return self._fd

    def linked(self) -> bool:
        """Whether the file is still the object's cache file (not evicted)."""
        try:
            return os.fstat(self._fd).st_nlink > 0
        except OSError:
            return False

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # also drops a shared flock


class DiskStore(BlockStore):
    def __init__(self, cache_dir: str, block_size: int) -> None:
        self.root = os.path.join(cache_dir, "data")
        self.block_size = block_size
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def object_path(self, key: bytes, dataset: str) -> str:
        h = key.hex()
        return os.path.join(self.root, dataset, h[:2], h)

    def open(self, key: bytes, dataset: str, size: int) -> DiskObject:
        path = self.object_path(key, dataset)
        for _ in range(100):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                continue
            except OSError as exc:
                raise _disk_error(exc, path) from None
            try:
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
            except OSError as exc:
                os.close(fd)
                raise _disk_error(exc, path) from None
            return DiskObject(key, size, path, fd, self.block_size)
        raise CacheFSError(f"{path}: could not create its directory")

    def try_remove(self, key: bytes, dataset: str, on_locked) -> bool:
        path = self.object_path(key, dataset)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return bool(on_locked())
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if not on_locked():
                return False
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return True
        finally:
            os.close(fd)

    def try_keep_only(self, key: bytes, dataset: str, keep, on_locked) -> bool:
        # Blocks are never punched out of a file in place: a process with the file open and no lock (its cache of
        # descriptors, a kernel passthrough open) would read the hole as zeros. The kept blocks are copied to a
        # new file that is renamed over the old one, which then lives on, whole, for whoever has it open.
        path = self.object_path(key, dataset)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        tmp = f"{path}.keep.{os.getpid()}"
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            blocks = sorted(keep())  # (under the lock: no block is being written)
            if not blocks:
                if not on_locked():
                    return False
                os.unlink(path)
                return True
            size = os.fstat(fd).st_size
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(out, size)
                bs = self.block_size
                for idx in blocks:
                    lo = idx * bs
                    n = min(bs, size - lo)
                    if n > 0 and os.pwrite(out, os.pread(fd, n, lo), lo) != n:
                        raise OSError(errno.EIO, "short write")
            except OSError as exc:
                os.close(out)
                os.unlink(tmp)
                raise _disk_error(exc, tmp) from None
            os.close(out)
            if not on_locked():
                os.unlink(tmp)
                return False
            os.replace(tmp, path)
            return True
        finally:
            os.close(fd)

    def disk_usage(self) -> tuple[int, int]:
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

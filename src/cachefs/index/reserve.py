"""A few allocated blocks kept aside on the cache disk so that the index can always commit.

LMDB copies the pages a transaction changes, so even a transaction that only *deletes* records (eviction)
needs free space to commit. On a disk that other writers (or a capacity set larger than the disk) filled to
the last block, eviction would then fail for want of the space it is meant to free. The index keeps a small
file of really allocated blocks (``fallocate``) beside it; when a commit fails for lack of space, the file is
removed and the commit tried once more. The file comes back once the disk has room again.
"""

from __future__ import annotations

import logging
import os

from cachefs.base.files import atomic_write

__all__ = ["IndexReserve", "reserve_size"]

log = logging.getLogger(__name__)


def reserve_size(disk_total: int) -> int:
    """256 KiB on tiny disks, 1/256 of the disk in between, at most 16 MiB: a commit that deletes thousands of
    block records touches tens of pages; this is generous for it and negligible on a real NVMe."""
    return min(16 << 20, max(256 << 10, disk_total // 256))


class IndexReserve:
    """The reserve file at ``path`` (one per cache directory, shared by every process using it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def present(self) -> bool:
        return os.path.exists(self.path)

    def release(self) -> bool:
        """Give the reserved blocks back to the file system; True if there were any."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("cannot release the index reserve %s: %s", self.path, exc)
            return False
        log.warning("cache disk full: released the index's reserved space so that the index can commit")
        return True

    def restore(self, size: int, free: int) -> bool:
        """Put the reserve back if it is missing and the disk has twice its size free; True if it is there."""
        if self.present():
            return True
        if free < 2 * size:
            return False
        try:
            atomic_write(self.path, lambda f: os.posix_fallocate(f.fileno(), 0, size))
        except OSError:
            return False
        return True

"""Objects already on the origin, in a volume's tree: placeholders until opened, then downloaded whole.

At start the volume lists its prefix once; every object not written here becomes a sparse *placeholder* file of
the object's size, marked with the xattr ``user.cachefs.remote`` (its ETag), so that listings, ``stat`` and renames
need no request. Opening one downloads it (ranged GETs in parallel, within the memory budget) and marks it a clean
copy (``user.cachefs.etag``). Restoring a checkpoint on another node reads it this way.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os

from cachefs.base.errors import CacheFSError, ConfigError
from cachefs.node.budget import MemoryBudget
from cachefs.sources import Source

__all__ = ["CLEAN", "COPY", "DIRTY", "REMOTE", "check_xattrs", "download", "download_copy", "is_internal", "list_into_tree",
           "place_copy", "to_placeholder", "xattr"]

log = logging.getLogger(__name__)

REMOTE = "user.cachefs.remote"  # a placeholder: the object's ETag; the bytes are on the origin only
CLEAN = "user.cachefs.etag"  # a downloaded copy of that ETag
DIRTY = "user.cachefs.dirty"  # written since its last close: not yet in the upload queue
COPY = "user.cachefs.copy"  # a placeholder of a copy another member holds (JSON: member, entry, size)


def xattr(path: str, name: str) -> str | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False).decode()
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOENT):
            return None
        raise


def drop_xattr(path: str, name: str) -> None:
    try:
        os.removexattr(path, name, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.ENOENT):
            raise


def is_internal(key: str) -> bool:
    """Keys cachefs keeps beside checkpoints (claims, commit records): not part of the tree."""
    return key.startswith(".cachefs/") or "/.cachefs/" in key


async def list_into_tree(source: Source, url: str, tree: str, keep: set[str]) -> dict[str, tuple[int, str]]:
    """Make the tree show the objects under ``url``: placeholders for the new, the changed and the missing, and
    no clean copy of an object that is gone; paths in ``keep`` (written here, not uploaded yet) are left alone.
    Returns the objects on the origin, key → (size, ETag)."""
    found: dict[str, tuple[int, str]] = {}
    async for batch in source.list_tree(url):
        for entry in batch:
            if is_internal(entry.path) or entry.path.endswith("/"):
                continue
            found[entry.path] = (entry.size, entry.version)
            if entry.path in keep:
                continue
            await asyncio.to_thread(_place, tree, entry.path, entry.size, entry.version, entry.mtime)
    await asyncio.to_thread(_forget_gone, tree, found, keep)
    return found


def _place(tree: str, key: str, size: int, etag: str, mtime: float) -> None:
    path = os.path.join(tree, key)
    if os.path.isfile(path) and not os.path.islink(path):
        if xattr(path, DIRTY) is None and etag in (xattr(path, REMOTE), xattr(path, CLEAN)):
            return  # the same object, as a placeholder or a copy
        if xattr(path, DIRTY) is not None:
            return  # written here since: ours is newer
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.cachefs-placing"
        with open(tmp, "wb") as f:
            f.truncate(size)
        os.setxattr(tmp, REMOTE, etag.encode())
        os.utime(tmp, (mtime, mtime))
        os.replace(tmp, path)
    except (IsADirectoryError, NotADirectoryError, FileExistsError) as exc:
        # S3 allows both ``a`` and ``a/b``; a tree cannot show both
        log.warning("%s: not shown in the volume (%s: a file and a directory of one name)", key, exc.strerror)


def _forget_gone(tree: str, found: dict[str, tuple[int, str]], keep: set[str]) -> None:
    for dirpath, _dirs, files in os.walk(tree):
        for name in files:
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, tree)
            if key in found or key in keep or xattr(path, DIRTY) is not None:
                continue
            if xattr(path, REMOTE) is not None or xattr(path, CLEAN) is not None:
                os.unlink(path)  # deleted at the origin since we last listed it


def place_copy(tree: str, key: str, size: int, member: str, entry: str) -> None:
    """A placeholder of a file another member holds a copy of (its writer's upload has not finished)."""
    path = os.path.join(tree, key)
    if os.path.lexists(path):
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.cachefs-placing"
        with open(tmp, "wb") as f:
            f.truncate(size)
        os.setxattr(tmp, COPY, json.dumps([member, entry, size]).encode())
        os.replace(tmp, path)
    except (IsADirectoryError, NotADirectoryError, FileExistsError) as exc:
        log.warning("%s: not shown in the volume (%s)", key, exc.strerror)


async def download_copy(replicator, path: str, copy: str) -> None:
    """Fill the placeholder at ``path`` from the member holding its copy; afterwards it is a plain file here."""
    member, entry, size = json.loads(copy)
    fd = os.open(path, os.O_WRONLY)
    try:
        await replicator.fetch(member, entry, fd, size)
        await asyncio.to_thread(os.fsync, fd)
    finally:
        os.close(fd)
    drop_xattr(path, COPY)


def to_placeholder(path: str) -> None:
    """A clean copy becomes a placeholder again: its blocks are freed, its size and ETag kept."""
    etag = xattr(path, CLEAN)
    if etag is None:
        return
    size = os.lstat(path).st_size
    os.setxattr(path, REMOTE, etag.encode())
    drop_xattr(path, CLEAN)
    os.truncate(path, 0)
    os.truncate(path, size)


async def download(source: Source, url: str, path: str, *, part_size: int, concurrency: int,
                   budget: MemoryBudget | None) -> None:
    """Fill the placeholder at ``path`` with the object at ``url``; afterwards it is a clean copy."""
    etag = xattr(path, REMOTE)
    if etag is None:
        return
    size = os.stat(path).st_size
    fd = os.open(path, os.O_WRONLY)
    gate = asyncio.Semaphore(concurrency)

    async def part(start: int) -> None:
        end = min(size, start + part_size)
        async with gate:
            reservation = await budget.take(end - start) if budget is not None else None
            try:
                data = await source.read(url, etag, start, end)
                await asyncio.to_thread(os.pwrite, fd, data, start)
            finally:
                if reservation is not None:
                    await reservation.release()

    try:
        await asyncio.gather(*(part(s) for s in range(0, size, part_size)))
        await asyncio.to_thread(os.fsync, fd)
    except CacheFSError:
        raise
    finally:
        os.close(fd)
    os.setxattr(path, CLEAN, etag.encode())
    drop_xattr(path, REMOTE)


def check_xattrs(path: str) -> None:
    """Refuse (ConfigError) a file system that does not keep user xattrs: the tree's files carry their state in them."""
    probe = os.path.join(path, ".cachefs-xattr-probe")
    try:
        with open(probe, "wb"):
            pass
        os.setxattr(probe, "user.cachefs.probe", b"1")
    except OSError as exc:
        raise ConfigError(f"{path}: the cache directory's file system does not keep user xattrs ({exc.strerror}); "
                          "writable volumes need them") from None
    finally:
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass

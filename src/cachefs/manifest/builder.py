"""Taking a dataset's manifest: one parallel listing of the origin, written as a new immutable version. A listing
whose process was killed is resumed by the next one (:mod:`.units`)."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os

from cachefs.base.errors import BucketNotFoundError, ObjectNotFoundError, bucket_of
from cachefs.base.types import DatasetRef
from cachefs.index import DatasetRecord, Index, ManifestInfo
from cachefs.index.listings import ListingProgress, interrupted_listing
from cachefs.index.mounts import pinned_versions
from cachefs.manifest.store import ManifestStore, ManifestWriter
from cachefs.manifest.units import list_in_units
from cachefs.sources import Source

__all__ = ["KEEP_VERSIONS", "take_snapshot"]

log = logging.getLogger(__name__)

#: Manifest versions kept per dataset: the newest and two older ones, so jobs pinned to the previous
#: snapshot keep working across a refresh or two. Older versions are dropped at the next refresh.
KEEP_VERSIONS = 3


async def take_snapshot(index: Index, source: Source, ds: DatasetRef, *, concurrency: int,
                        only_if_missing: bool = False) -> DatasetRecord:
    """List ``ds`` once and store the listing as its new current manifest version (``concurrency``: parts of the
    tree listed at a time, ``origin.list_concurrency``).

    Several processes may ask at once; a per-dataset file lock makes them take turns, and with
    ``only_if_missing`` a later one reuses the snapshot an earlier one just took instead of listing again.
    """
    lock_dir = os.path.join(os.path.dirname(index.path), "locks")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, f"{ds.id}.manifest"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        await _lock(fd)
        rec = index.dataset(ds.id) or DatasetRecord(ds.id, ds.url)
        if only_if_missing and rec.manifests:
            return rec
        return await _snapshot_locked(index, source, ds, rec, concurrency)
    finally:
        os.close(fd)


async def _lock(fd: int) -> None:
    # Poll rather than block in a worker thread: many waiters must not tie up the default executor, which
    # the listing itself may need.
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            await asyncio.sleep(0.05)


async def _snapshot_locked(index: Index, source: Source, ds: DatasetRef, rec: DatasetRecord,
                           concurrency: int) -> DatasetRecord:
    store = ManifestStore(index)
    version = max((m.version for m in rec.manifests), default=0) + 1
    cache_dir = os.path.dirname(index.path)
    done = interrupted_listing(cache_dir, ds.id, version)
    if done is None:
        store.drop(ds.id, version)  # leftovers of a listing that crashed before it was committed
    else:
        log.info("%s: resuming the listing of manifest v%d (%d parts listed before)", ds.url, version, len(done))
    writer = ManifestWriter(index, ds.id, version, resumed=done is not None)
    progress = ListingProgress(cache_dir, ds.id, ds.url, version)  # (what `cachefs status` shows meanwhile)
    progress.units_done.update(done or ())
    ticker = asyncio.ensure_future(progress.keep_written())
    try:
        await list_in_units(source, ds.url, writer, progress, concurrency)
    except BucketNotFoundError:
        store.drop(ds.id, version)
        raise BucketNotFoundError(f"{ds.url}: bucket {bucket_of(ds.url)} not found: it does not exist at the "
                                  "origin") from None
    except ObjectNotFoundError:
        store.drop(ds.id, version)
        raise ObjectNotFoundError(f"{ds.url}: dataset not found at the origin") from None
    except BaseException:
        store.drop(ds.id, version)
        raise
    finally:
        ticker.cancel()
        progress.done()
    if writer.resumed:
        writer.recount()
    if writer.files == 0 and not writer.skipped:
        store.drop(ds.id, version)
        raise ObjectNotFoundError(f"{ds.url}: no objects under this prefix (is the URL right?)")
    for path, why in writer.skipped_examples:
        log.warning("%s: skipped %r (%s)", ds.url, path, why)
    if writer.skipped > len(writer.skipped_examples):
        log.warning("%s: skipped %d names in all", ds.url, writer.skipped)
    rec.manifests.append(ManifestInfo(version, writer.created, writer.files, writer.bytes, writer.skipped,
                                      writer.largest))
    rec.current = version
    # The newest KEEP_VERSIONS stay, and any version a live mount serves (its next daemon must find it).
    pinned = pinned_versions(os.path.dirname(index.path), ds.url)
    dropped = [m for m in rec.manifests[:-KEEP_VERSIONS] if m.version not in pinned]
    rec.manifests = [m for m in rec.manifests if m not in dropped]
    index.put_dataset(rec)  # the commit point: readers switch to the new version here
    for old in dropped:
        store.drop(ds.id, old.version)
    log.info("%s: manifest v%d, %d files, %d bytes", ds.url, version, writer.files, writer.bytes)
    return rec

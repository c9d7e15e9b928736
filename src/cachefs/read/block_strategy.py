"""Large objects, read in blocks: the object's bytes in one sparse local file, block ``i`` at ``i × block_size``.

A read is split into blocks. Blocks the index lists as present are read from the local file and verified
against their xxh3 (once per block per process). Missing blocks are fetched (:mod:`cachefs.read.block_fetches`:
single-flight, through the tier chain), written, and only then recorded in the index. Other processes see the
record and read the file; they may occasionally fetch the same block too (harmless: same version, same bytes,
same offset).

A sequential reader gets read-ahead (:func:`~cachefs.prefetch.planners.grow_window`): the window's missing blocks
are handed to the prefetcher (:mod:`cachefs.prefetch.prefetcher`), which fetches them with spare memory only, so
read-ahead never starves demand reads. Sync callers (fsspec files, FUSE threads) read present blocks from their
own thread (:meth:`BlockStrategy.read_local`) and hand the prefetcher the window from there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

from cachefs.base.checksum import block_checksum
from cachefs.base.config import Config
from cachefs.base.errors import CorruptBlockError
from cachefs.base.types import Entry, object_key
from cachefs.manifest.dataset import Dataset
from cachefs.node.admission import Admission
from cachefs.node.budget import Reservation
from cachefs.node.disk_jobs import DiskJobs
from cachefs.node.funnel import OriginFunnel
from cachefs.node.open_objects import OpenObject, OpenObjects
from cachefs.node.read_stats import ReadStats
from cachefs.prefetch.planners import blocks_ahead, grow_window
from cachefs.prefetch.prefetcher import Hint, Prefetcher
from cachefs.read.base import ReadStrategy, ReadStream
from cachefs.read.block_fetches import BlockFetches
from cachefs.read.block_file import BlockFile
from cachefs.store.disk import PIECE
from cachefs.tiers import TierChain

__all__ = ["BlockFile", "BlockStrategy"]

log = logging.getLogger(__name__)


class BlockStrategy(ReadStrategy):
    packed = False

    def __init__(self, config: Config, objects: OpenObjects, chain: TierChain, funnel: OriginFunnel,
                 admission: Admission, disk: DiskJobs, stats: ReadStats, prefetcher: Prefetcher) -> None:
        self.block_size = config.cache.block_size
        self.max_window = config.engine.readahead_max // self.block_size
        self.objects, self.chain, self.admission, self.stats = objects, chain, admission, stats
        self.prefetcher = prefetcher
        self.fetches = BlockFetches(config, objects, chain, funnel, admission, disk, stats)

    def open(self, ds: Dataset, entry: Entry, *, pin: bool = True) -> BlockFile:
        """A reader opens ``entry``: with ``pin``, eviction by any process skips it until it is closed."""
        return BlockFile(self, ds, entry, self.objects.pin(ds.ref.id, entry) if pin else None, ReadStream())

    def oneoff(self, ds: Dataset, entry: Entry, stream: ReadStream | None) -> BlockFile:
        return BlockFile(self, ds, entry, None, stream)

    # -- local reads (any thread) ---------------------------------------------------------------------------
    def read_local(self, ds: Dataset, entry: Entry, start: int, end: int, stream: ReadStream | None,
                   okey: bytes | None = None) -> bytes | None:
        with self.objects.using(ds.ref.id, entry, okey) as ob:
            bs = self.block_size
            first, last = start // bs, (end - 1) // bs
            if not all(self.objects.has(ob, i) for i in range(first, last + 1)):
                return None
            try:
                if stream is not None and first == last:
                    data = self._within_block(ob, stream, first, start, end)
                else:
                    data = ob.stored.read(start, end, ob.present)
            except CorruptBlockError as exc:
                self._drop_corrupt(ob, exc)
                return None
            ahead = self.stats.take_blocks_ahead(ob.key, start, end, bs, ob.record.size)
            self.count(ob, ds.ref.id, stream, hit=len(data) - ahead, miss=ahead)
            if stream is not None:
                self._advance(stream, start, end)
                if stream.window:
                    self.keep_ahead(ds, entry, ob, stream)
            if (not ob.whole and len(ob.present) == ob.nblocks and not self.stats.any_block_ahead(ob.key)
                    and ob.stored.all_verified(ob.nblocks)):
                ob.whole = True
            return data

    def read_whole(self, ob: OpenObject, ds: Dataset, start: int, end: int, stream: ReadStream) -> bytes:
        """``[start, end)`` of an object this reader holds that is whole here (OpenObject.whole): read directly,
        nothing to fetch, verify or read ahead."""
        data = ob.stored.read_verified(start, end)
        self.count(ob, ds.ref.id, stream, hit=len(data))
        stream.next_offset = end
        return data

    def _within_block(self, ob: OpenObject, stream: ReadStream, idx: int, start: int, end: int) -> bytes:
        """``[start, end)`` of block ``idx`` for a reader moving through it: a block not verified yet is read and
        verified whole once, and its pieces serve this read and the stream's next ones in the block (in a fresh
        process every block is verified at its first read: without this, it was read twice)."""
        kept = stream.block
        if kept is None or kept[0] != ob.key or kept[1] != idx:
            if ob.stored.verified(idx):
                return ob.stored.read(start, end, ob.present)
            kept = stream.block = (ob.key, idx, ob.stored.read_block(idx, ob.present[idx]))
        lo = idx * self.block_size
        if end >= min(lo + self.block_size, ob.record.size):
            stream.block = None  # the reader is through this block
        return _slice(kept[2], start - lo, end - lo)

    def keep_ahead(self, ds: Dataset, entry: Entry, ob: OpenObject, stream: ReadStream) -> None:
        """From a thread serving local reads: hand the prefetcher what is missing in the read-ahead window. Only
        the async path would start read-ahead otherwise, so a sequential reader served locally (the cached part of
        a file, or blocks read ahead earlier) would run into the next missing block and wait for a whole window to
        be fetched: through FUSE, half-cached files read at 0.33 GB/s, the engine 0.88."""
        ahead = blocks_ahead(stream.next_offset, stream.window, self.block_size, ob.nblocks)
        if ahead.stop <= stream.ahead_to:
            return
        lo, stream.ahead_to = max(ahead.start, stream.ahead_to), ahead.stop
        missing = [i for i in range(lo, ahead.stop) if i not in ob.present]
        if missing and not self.fetches.closing:
            self.prefetcher.offer_threadsafe([self._hint(ds, entry, ob.key, i) for i in missing])

    # -- reads that may fetch (event loop) ------------------------------------------------------------------
    async def read(self, ds: Dataset, entry: Entry, start: int, end: int, stream: ReadStream | None,
                   okey: bytes | None = None) -> bytes:
        with self.objects.using(ds.ref.id, entry, okey) as ob:
            bs = self.block_size
            first, last = start // bs, (end - 1) // bs
            for _attempt in range(3):
                missing = [i for i in range(first, last + 1) if not self.objects.has(ob, i)]
                fetched: dict[int, bytes] = {}
                if missing:
                    fetched = self.fetches.kept(ob.key, missing)
                    missing = [i for i in missing if i not in fetched]
                    got = await asyncio.gather(*(self.fetches.bring(ds, entry, ob, i) for i in missing))
                    fetched.update((i, b) for i, b in zip(missing, got, strict=True) if b is not None)
                try:
                    data = self._assemble(ob, start, end, fetched)
                    break
                except CorruptBlockError as exc:
                    self._drop_corrupt(ob, exc)
            else:
                raise CorruptBlockError(f"{entry.path}: blocks keep failing their checksums; is the cache disk healthy?")
            fetched_bytes = self.stats.take_blocks_ahead(ob.key, start, end, bs, entry.size)
            fetched_bytes += sum(min(end, (i + 1) * bs) - max(start, i * bs) for i in fetched)
            if last in fetched and end < min((last + 1) * bs, entry.size):
                # The rest of that block came for this reader too: a miss when it gets there.
                self.stats.note_block_ahead(ob.key, last)
            self.count(ob, ds.ref.id, stream, hit=max(0, len(data) - fetched_bytes), miss=min(len(data), fetched_bytes))
            if stream is not None:
                self._advance(stream, start, end)
                self._read_ahead(ds, entry, ob, stream)
            return data

    async def ensure(self, ds: Dataset, entry: Entry, on_bytes: Callable[[int], None] | None = None) -> None:
        """Make every block present (prefetch); CacheFullError when the disk cannot take them. ``on_bytes(n)``
        as each block lands."""
        with self.objects.using(ds.ref.id, entry) as ob:
            async def block(i: int) -> None:
                await self.fetches.bring(ds, entry, ob, i, strict=True)
                if on_bytes is not None:
                    on_bytes(min(self.block_size, entry.size - i * self.block_size))

            await asyncio.gather(*(block(i) for i in range(ob.nblocks) if not self.objects.has(ob, i)))

    def _assemble(self, ob: OpenObject, start: int, end: int, fetched: dict[int, bytes]) -> bytes:
        if not fetched:
            return ob.stored.read(start, end, ob.present)
        bs = self.block_size
        parts: list[bytes | memoryview] = []
        for i in range(start // bs, (end - 1) // bs + 1):
            lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
            block = fetched.get(i)
            if block is not None:
                parts.append(memoryview(block)[lo - i * bs : hi - i * bs])
            else:
                parts.append(ob.stored.read(lo, hi, ob.present))
        return b"".join(parts)

    def _drop_corrupt(self, ob: OpenObject, exc: CorruptBlockError) -> None:
        self.stats.note_corrupt("block")
        log.warning("dataset %s, %s: block %s failed its checksum on this node's disk (%s); dropped, fetched again",
                    ob.record.dataset, ob.record.path, exc.block, ob.stored.path)
        if exc.block is not None:
            self.objects.drop_corrupt(ob, exc.block)

    def _advance(self, stream: ReadStream, start: int, end: int) -> None:
        stream.window = grow_window(stream.window, start == stream.next_offset, self.max_window)
        stream.next_offset = end

    # -- read-ahead -----------------------------------------------------------------------------------------
    def _read_ahead(self, ds: Dataset, entry: Entry, ob: OpenObject, stream: ReadStream) -> None:
        if stream.window == 0 or self.fetches.closing:
            return
        hints = []
        for i in blocks_ahead(stream.next_offset, stream.window, self.block_size, ob.nblocks):
            key = (ob.key, i)
            if self.objects.has(ob, i) or self.fetches.under_way(*key) or key in self.prefetcher:
                continue
            hints.append(self._hint(ds, entry, ob.key, i))
        if hints:
            self.prefetcher.offer(hints)

    def _hint(self, ds: Dataset, entry: Entry, okey: bytes, idx: int) -> Hint:
        return Hint((okey, idx), min(self.block_size, entry.size - idx * self.block_size), "sequential",
                    functools.partial(self._fetch_ahead, ds, entry, okey, idx))

    async def _fetch_ahead(self, ds: Dataset, entry: Entry, okey: bytes, idx: int, held: Reservation | None) -> None:
        """Read block ``idx`` ahead (the prefetcher runs this with memory ``held`` for it)."""
        with self.objects.using(ds.ref.id, entry, okey) as ob:
            if self.fetches.closing or self.objects.has(ob, idx) or self.fetches.fetching(okey, idx):
                return
            self.stats.note_block_ahead(okey, idx)  # before its bytes are visible: a reader then counts a miss
            try:
                await self.fetches.bring(ds, entry, ob, idx, held=held)
            except BaseException:
                self.stats.forget_block_ahead(okey, idx)
                raise

    # -- serving peers ----------------------------------------------------------------------------------------
    async def serve(self, ds: Dataset, entry: Entry, idx: int | None, *, fetch: bool) -> tuple[bytes, int] | None:
        """Block ``idx`` for a peer, with the checksum recorded for it: from this node's disk (verified), or with
        ``fetch`` (this node owns it) fetched through this process's chain first, once whoever asks; None if it
        is not here and not this node's to fetch. Only bytes the index records are ever sent."""
        if idx is None:
            return None
        bs = self.block_size
        length = min(bs, entry.size - idx * bs)
        with self.objects.using(ds.ref.id, entry) as ob:
            for _ in range(2):
                if self.objects.has(ob, idx):
                    try:
                        data = ob.stored.read(idx * bs, idx * bs + length, ob.present)
                    except CorruptBlockError as exc:
                        self._drop_corrupt(ob, exc)
                        continue
                    return data, ob.present[idx][0]
                if not fetch:
                    return None
                got = await self.fetches.bring(ds, entry, ob, idx)
                if got is not None:
                    return bytes(got), block_checksum(got)
            return None

    def ahead_hints(self, ds: Dataset, entry: Entry) -> list[Hint]:
        if self.admission.ahead_refusing(ds.ref.id):
            return []
        okey = object_key(ds.ref.id, entry.path, entry.version)
        with self.objects.using(ds.ref.id, entry, okey) as ob:
            missing = [i for i in range(ob.nblocks) if not self.objects.has(ob, i)
                       and not self.fetches.under_way(okey, i)]
        return [dataclasses.replace(self._hint(ds, entry, okey, i), kind="order") for i in missing]

    # -- what is here ---------------------------------------------------------------------------------------
    def cached_bytes(self, ds: Dataset, entry: Entry, okey: bytes) -> int:
        ob = self.objects.get(okey)
        if ob is not None:
            return sum(length for _, length in ob.present.values())
        rec = self.objects.index.object(okey)
        return rec.cached_bytes if rec else 0

    def local_path(self, ds: Dataset, entry: Entry) -> str | None:
        """Path of the complete local file of ``entry``, or None if some block is missing (or it is evicted)."""
        with self.objects.using(ds.ref.id, entry) as ob:
            return ob.stored.path if self.objects.complete(ob) else None

    # -- counting -------------------------------------------------------------------------------------------
    def count(self, ob: OpenObject, ds_id: str, stream: ReadStream | None, hit: int = 0, miss: int = 0) -> None:
        access = stream is None or not stream.counted
        if access:
            ob.hits += 1
            ob.last_access = time.time()
            if stream is not None:
                stream.counted = True
        self.stats.count(ds_id, ob.record.path if access else None, hit, miss)

    def stop(self) -> list[asyncio.Future]:
        """Stop starting work; the fetches and read-ahead in flight (for the caller to cancel and await)."""
        return self.fetches.stop()


def _slice(pieces: list[bytes], lo: int, hi: int) -> bytes:
    """Bytes ``[lo, hi)`` of the concatenation of ``pieces`` (each PIECE bytes but the last): a piece itself
    when the range is exactly one, so that aligned reads cost no copy."""
    i, j = lo // PIECE, (hi - 1) // PIECE
    if i == j:
        piece = pieces[i]
        a, b = lo - i * PIECE, hi - i * PIECE
        return piece if (a, b) == (0, len(piece)) else piece[a:b]
    return b"".join([pieces[i][lo - i * PIECE:], *pieces[i + 1:j], pieces[j][:hi - j * PIECE]])

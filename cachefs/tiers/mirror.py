"""A dataset's packed mirror (:mod:`cachefs.formats.mirror_index`) as a tier: small files as ranges of a few large packs.

A miss on a small file the mirror holds (under the version the reader's manifest names) fetches the window of
about :data:`MIRROR_WINDOW` bytes that holds it, so its reader waits for one ranged GET; the other windows of
that pack follow, and so does the next pack (:func:`~cachefs.prefetch.planners.mirror_windows`). Every window is
installed on this node as it is (:mod:`cachefs.node.pack_assembly`), so the files that came with it are local
when their readers ask. Files the mirror does not have (larger ones, or changed at the source since it was
written) are not this tier's: the next tier serves them.
"""

from __future__ import annotations

import asyncio
import logging

from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CacheFSError
from cachefs.formats.mirror_index import MirrorIndex, load_mirror
from cachefs.index import Index
from cachefs.manifest.dataset import Dataset
from cachefs.node.flight import SingleFlight
from cachefs.node.funnel import OriginFunnel
from cachefs.node.pack_assembly import PackAssemblies
from cachefs.node.read_stats import ReadStats
from cachefs.prefetch.planners import mirror_windows, window_of
from cachefs.tiers.base import Tier, Want

__all__ = ["MIRROR_WINDOW", "MirrorTier"]

log = logging.getLogger(__name__)

#: The ranged GETs a mirror pack is fetched in; a miss waits for the one that holds its file.
MIRROR_WINDOW = 8 * 1024 * 1024


class MirrorTier(Tier):
    name = "mirror"

    def __init__(self, funnel: OriginFunnel, assemblies: PackAssemblies, index: Index, stats: ReadStats) -> None:
        self.funnel, self.assemblies, self.index, self.stats = funnel, assemblies, index, stats
        self._mirrors: dict[str, MirrorIndex | None] = {}  # dataset id → its mirror (None: it has none)
        self._locks: dict[str, asyncio.Lock] = {}
        self._windows = SingleFlight()  # (dataset id, pack, window) → (start, bytes, keys of this manifest in it)
        #: Files fetched from mirrors, and the GETs that brought them.
        self.files = self.gets = 0

    async def mirror(self, ds: Dataset) -> MirrorIndex | None:
        """The dataset's mirror, looked up once through the dataset's own source (its credentials and
        endpoint)."""
        ds_id = ds.ref.id
        if ds_id not in self._mirrors:
            async with self._locks.setdefault(ds_id, asyncio.Lock()):
                if ds_id not in self._mirrors:
                    try:
                        self._mirrors[ds_id] = await load_mirror(ds.ref, ds.source)
                    except (CacheFSError, ValueError, KeyError) as exc:
                        log.warning("%s: cannot use its packed mirror (%s); reading files one by one", ds.ref.url, exc)
                        self._mirrors[ds_id] = None
                    if self._mirrors[ds_id] is not None:
                        log.info("%s: using its packed mirror %s", ds.ref.url, self._mirrors[ds_id].url)
        return self._mirrors[ds_id]

    def _here(self, okey: bytes) -> bool:
        return self.index.packed(okey) is not None or self.assemblies.holds(okey)

    async def fetch(self, want: Want) -> bytes | None:
        if not want.whole:
            return None
        mirror = await self.mirror(want.ds)
        if mirror is None or want.okey not in mirror.entries:
            return None
        pack, offset, length, _ck = mirror.entries[want.okey]
        windows, here = {}, {}
        for p in (pack, pack + 1):
            if p < len(mirror.packs):
                windows[p] = len(mirror.bounds(p, MIRROR_WINDOW)) - 1
                first = mirror.layout[p][:1]
                here[p] = bool(first) and not self.assemblies.assembling(want.ds.ref.id, p) and self._here(first[0][2])
        mine = None
        for p, w in mirror_windows(pack, window_of(mirror.bounds(pack, MIRROR_WINDOW), offset), windows, here):
            fut = self._window(want.ds, mirror, p, w)
            if mine is None:
                mine = fut
                if fut is None:  # its window was written here, yet the file was not found there
                    raise CacheFSError(f"{mirror.url}: pack {pack}: the window written here does not hold the file")
        lo, raw, valid = await asyncio.shield(mine)
        if want.okey not in valid:
            raise CacheFSError(f"{mirror.url}: pack {pack}: the window fetched did not hold the file")
        return bytes(memoryview(raw)[offset - lo:offset - lo + length])

    def _window(self, ds: Dataset, mirror: MirrorIndex, pack: int, window: int) -> asyncio.Future | None:
        """The (single-flight) fetch of one window, resolving to (its start, its bytes, the object keys in it that
        this manifest names); None if that window is written here already."""
        key = (ds.ref.id, pack, window)
        fut = self._windows.get(key)
        if fut is None:
            if self.assemblies.window_done(ds.ref.id, pack, window):
                return None
            fut = self._windows.start(key, self._fetch_window(ds, mirror, pack, window))
        return fut

    async def _fetch_window(self, ds: Dataset, mirror: MirrorIndex, pack: int, window: int
                            ) -> tuple[int, bytes, set[bytes]]:
        bounds = mirror.bounds(pack, MIRROR_WINDOW)
        lo, hi = bounds[window], bounds[window + 1]
        url, version = mirror.packs[pack]
        async with await self.funnel.hold(hi - lo):
            raw = await self.funnel.get(ds.source, url, version, lo, hi - lo)
            self.gets += 1
            if len(raw) != hi - lo:
                raise CacheFSError(f"{url}: {len(raw)} bytes for a window of {hi - lo}")
            view, valid, keep = memoryview(raw), set(), []
            for off, length, okey, checksum, path, file_version in mirror.window(pack, lo, hi):
                try:
                    if ds.stat(path).version != file_version:
                        continue  # changed at the source since it was packed: the manifest names another version
                except OSError:
                    continue  # not in this manifest at all
                if block_checksum(view[off - lo:off - lo + length]) != checksum:
                    raise CacheFSError(f"{url}: a member failed its checksum")
                valid.add(okey)
                if not self._here(okey):
                    keep.append((okey, off, length, checksum))
            self.files += len(valid)
            self.stats.note_ahead([k[0] for k in keep])  # the one a reader asked for is counted as fetched anyway
            await self.assemblies.write(ds.ref.id, pack, mirror.pack_sizes[pack], len(bounds) - 1, window, lo, raw,
                                        keep)
        return lo, raw, valid

    async def drain(self) -> None:
        """Wait for the windows on the wire and the packs they complete."""
        while len(self._windows):
            await asyncio.gather(*self._windows.runs(), return_exceptions=True)
        await self.assemblies.drain()

    def stop(self) -> list[asyncio.Future]:
        """The windows in flight (to cancel at shutdown)."""
        return self._windows.runs()

"""A dataset's packed mirror (:mod:`cachefs.formats.mirror_index`) as a tier: small files as ranges of a few large
packs.

A miss on a small file the mirror holds (under the version the reader's manifest names) fetches the window of
about :data:`MIRROR_WINDOW` bytes that holds it, so its reader waits for one ranged GET. The tier answers with
the file's bytes and the whole window (:class:`~cachefs.formats.mirror_index.MirrorWindow`, every member the
manifest names verified); the pack read strategy installs the window as it is, so the files that came with it
are local when their readers ask, and plans the rest of the pack and the next one as read-ahead
(:meth:`MirrorTier.batches_after`). Files the mirror does not have (larger ones, or changed at the source since
it was written) are not this tier's: the next tier serves them.
"""

from __future__ import annotations

import asyncio
import logging

from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CacheFSError, ObjectNotFoundError
from cachefs.base.types import DatasetRef
from cachefs.formats.mirror_index import MirrorIndex, MirrorWindow, mirror_url_for, parse_index, parse_meta
from cachefs.manifest.dataset import Dataset
from cachefs.node.budget import Reservation
from cachefs.node.flight import SingleFlight
from cachefs.node.funnel import OriginFunnel
from cachefs.prefetch.planners import mirror_windows, window_of
from cachefs.sources import Source
from cachefs.tiers.base import BatchRef, Keep, Kind, Served, Tier, TierParts, Want

__all__ = ["MIRROR_WINDOW", "MirrorTier", "load_mirror"]

log = logging.getLogger(__name__)

#: The ranged GETs a mirror pack is fetched in; a miss waits for the one that holds its file.
MIRROR_WINDOW = 8 * 1024 * 1024


async def load_mirror(ref: DatasetRef, source: Source, url: str | None = None) -> MirrorIndex | None:
    """The mirror of dataset ``ref`` at ``url`` (default ``<dataset URL>.cachefs``), read through ``source`` (the
    dataset's own, with its credentials and endpoint, or the one it was written with), or None if there is none
    (or it is of another dataset, another format, or incomplete)."""

    url = (url or mirror_url_for(ref.url)).rstrip("/")
    src = source
    try:
        st = await src.stat(f"{url}/mirror.json")
    except ObjectNotFoundError:
        return None
    meta = parse_meta(ref, url, await src.read(f"{url}/mirror.json", st.version, 0, st.size))
    if meta is None:
        return None
    idx = meta["index"]
    return parse_index(ref, url, meta, await src.read(f"{url}/{idx['name']}", idx["version"], 0, idx["size"]))



class MirrorTier(Tier):
    name = "mirror"

    def __init__(self, funnel: OriginFunnel) -> None:
        self.funnel = funnel
        self._mirrors: dict[str, MirrorIndex | None] = {}  # dataset id → its mirror (None: it has none)
        self._locks: dict[str, asyncio.Lock] = {}
        self._windows = SingleFlight()  # (dataset id, pack, window) → MirrorWindow
        #: Files fetched from mirrors, and the GETs that brought them.
        self.files = self.gets = 0
        #: Dataset id → why its mirror exists but cannot be used (what `cachefs status` shows for a mount).
        self.problems: dict[str, str] = {}

    @classmethod
    def build(cls, parts: TierParts, kind: Kind) -> MirrorTier | None:
        return cls(parts.funnel) if kind == "small" else None

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
                        self.problems[ds_id] = str(exc) or type(exc).__name__
                    found = self._mirrors[ds_id]
                    if found is not None:
                        log.info("%s: using its packed mirror %s", ds.ref.url, found.url)
        return self._mirrors[ds_id]

    async def fetch(self, want: Want) -> Served | None:
        if not want.whole:
            return None
        mirror = await self.mirror(want.ds)
        if mirror is None or want.okey not in mirror.entries:
            return None
        pack, offset, _length, _ck = mirror.entries[want.okey]
        # (the caller holds memory for the file it asked for: the window's fetch holds only the rest)
        window = await self._window(want.ds, pack, window_of(mirror.bounds(pack, MIRROR_WINDOW), offset), None,
                                    want.length)
        data = window.member(want.okey)
        if data is None:
            raise CacheFSError(f"{mirror.url}: pack {pack}: the window fetched did not hold the file")
        return Served(data, self.name, Keep.OWN, window)

    def problem(self, ds_id: str) -> str | None:
        return self.problems.get(ds_id)

    def batches_after(self, window: MirrorWindow) -> list[BatchRef]:
        """The rest of ``window``'s pack, then the next pack's windows, in that order."""
        mirror = self._mirrors.get(window.ds_id)
        if mirror is None:
            return []
        counts = {p: len(mirror.bounds(p, MIRROR_WINDOW)) - 1 for p in (window.pack, window.pack + 1)
                  if p < len(mirror.packs)}
        refs = []
        for p, w in mirror_windows(window.pack, window.window, counts, {})[1:]:
            bounds = mirror.bounds(p, MIRROR_WINDOW)
            first = mirror.layout[p][0][2] if mirror.layout[p] else None
            refs.append(BatchRef(window.ds_id, self.name, p, w, bounds[w + 1] - bounds[w], first))
        return refs

    async def fetch_batch(self, ds: Dataset, ref: BatchRef, held: Reservation | None) -> MirrorWindow:
        return await self._window(ds, ref.pack, ref.window, held, 0)

    async def _window(self, ds: Dataset, pack: int, window: int, held: Reservation | None,
                      asked: int) -> MirrorWindow:
        """Window ``window`` of ``pack`` (single-flight: one GET however many ask). ``held``: memory reserved for it
        already (read-ahead), used for the fetch or given back; ``asked``: bytes of it the caller holds memory
        for (the file it asked for)."""
        key = (ds.ref.id, pack, window)
        fut = self._windows.get(key)
        if fut is None:
            fut = self._windows.start(key, self._fetch_window(ds, pack, window, held, asked))
        elif held is not None:
            await held.release()
        return await asyncio.shield(fut)

    async def _fetch_window(self, ds: Dataset, pack: int, window: int, held: Reservation | None,
                            asked: int) -> MirrorWindow:
        mirror = await self.mirror(ds)
        if mirror is None:
            raise CacheFSError(f"{ds.ref.url}: its packed mirror went away")
        bounds = mirror.bounds(pack, MIRROR_WINDOW)
        lo, hi = bounds[window], bounds[window + 1]
        url, version = mirror.packs[pack]
        async with held or await self.funnel.hold(max(0, hi - lo - asked)):
            raw = await self.funnel.get(ds.source, url, version, lo, hi - lo)
        self.gets += 1
        if len(raw) != hi - lo:
            raise CacheFSError(f"{url}: {len(raw)} bytes for a window of {hi - lo}")
        view, members = memoryview(raw), []
        for off, length, okey, checksum, path, file_version in mirror.window(pack, lo, hi):
            try:
                if ds.stat(path).version != file_version:
                    continue  # changed at the source since it was packed: the manifest names another version
            except OSError:
                continue  # not in this manifest at all
            if block_checksum(view[off - lo:off - lo + length]) != checksum:
                raise CacheFSError(f"{url}: a member failed its checksum")
            members.append((okey, off, length, checksum))
        self.files += len(members)
        return MirrorWindow(ds.ref.id, pack, mirror.pack_sizes[pack], len(bounds) - 1, window, lo, raw,
                            tuple(members))

    async def drain(self) -> None:
        """Wait for the windows on the wire."""
        while len(self._windows):
            await asyncio.gather(*self._windows.runs(), return_exceptions=True)

    def stop(self) -> list[asyncio.Future]:
        """The windows in flight (to cancel at shutdown)."""
        return self._windows.runs()

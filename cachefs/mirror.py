"""A packed mirror of a dataset on object storage: its small files as a few large pack objects plus an index.

Cold reads of many small files are bound by the origin's per-request cost (a GET each); a mirror lets a node
fetch them as ranges of large pack objects instead, a few big sequential GETs, while readers still see the
original tree. ``cachefs pack URL`` writes it next to the dataset (``<URL>.cachefs/``), where every node
looks for it:

``mirror.json``
    ``{"format": 1, "source": URL, "manifest_version": N, "created": t, "files": n, "bytes": b,
    "packs": [{"name", "size", "version"}], "index": {"name", "size", "version"}}``; written last, so a mirror
    without it (an interrupted ``cachefs pack``) is ignored.
``packs/pNNNNNN.arrow``
    pack files in the node's own format (:mod:`cachefs.store.packs`): files in path order, so a directory's
    files sit together. A node installs a pack it fetches as it is (:mod:`cachefs.mirror_fetch`).
``index.arrow``
    an Arrow IPC file with one row per packed file: ``path``, ``version`` (the source's ETag/version when
    packed), ``size``, ``pack`` (position in ``packs``), ``offset``, ``length``, ``checksum`` (xxh3-64).

Staleness is per file: a reader looks a file up under the version its manifest names, so a file changed at
the source since the mirror was written simply has no mirror entry and is read from the source; the rest
still come from the mirror. The pack objects are read pinned to the version recorded for them, so a mirror
rewritten under a reader fails its reads (and the reader falls back to the source) instead of mixing bytes.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .checksum import block_checksum
from .errors import CacheFSError, ObjectNotFoundError
from .store.packs import Member, serialize
from .types import object_key

if TYPE_CHECKING:
    from .engine import Dataset, Engine
    from .sources import Source

__all__ = ["MIRROR_SUFFIX", "MirrorIndex", "MirrorSummary", "load_mirror", "mirror_url_for", "write_mirror"]

log = logging.getLogger(__name__)

MIRROR_SUFFIX = ".cachefs"
FORMAT = 1


def mirror_url_for(url: str) -> str:
    return url.rstrip("/") + MIRROR_SUFFIX


@dataclass
class MirrorSummary:
    url: str
    files: int = 0
    bytes: int = 0
    packs: int = 0
    skipped_large: int = 0
    seconds: float = 0.0
    verified: bool = False


@dataclass
class MirrorIndex:
    """A loaded mirror: object key (under the source version packed) → where its bytes are."""

    url: str
    packs: list[tuple[str, str]]  # (object URL, version) per pack
    pack_sizes: list[int] = field(default_factory=list)
    entries: dict[bytes, tuple[int, int, int, int]] = field(default_factory=dict)  # okey → pack, offset, len, ck
    # Per pack, members by offset: (offset, length, okey, checksum, path, version), to find a window's members.
    layout: list[list[tuple[int, int, bytes, int, str, str]]] = field(default_factory=list)

    _bounds: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def window(self, pack: int, start: int, end: int) -> list[tuple[int, int, bytes, int, str, str]]:
        """Members of ``pack`` whose bytes start in ``[start, end)``."""
        members = self.layout[pack]
        lo = bisect.bisect_left(members, (start,))
        hi = bisect.bisect_left(members, (end,))
        return members[lo:hi]

    def bounds(self, pack: int, window: int) -> list[int]:
        """Where the windows of ``pack`` start, and its size last: window ``w`` is bytes ``[b[w], b[w+1])``. The
        windows cover the whole pack file without overlap, each about ``window`` bytes, and a member never
        straddles two (a window ends where the first member starting past its nominal end begins)."""
        got = self._bounds.get((pack, window))
        if got is None:
            got, members, size = [0], self.layout[pack], self.pack_sizes[pack]
            for nominal in range(window, size, window):
                i = bisect.bisect_left(members, (nominal,))
                if i < len(members) and got[-1] < members[i][0] < size:
                    got.append(members[i][0])
            got.append(size)
            self._bounds[pack, window] = got
        return got


def _index_schema():
    import pyarrow as pa

    return pa.schema([("path", pa.string()), ("version", pa.string()), ("size", pa.uint64()), ("pack", pa.uint32()),
                      ("offset", pa.uint64()), ("length", pa.uint64()), ("checksum", pa.uint64())])


async def write_mirror(engine: Engine, ds: Dataset, to_url: str, *,
                       on_progress: Callable[[MirrorSummary], None] | None = None) -> MirrorSummary:
    """Write the packed mirror of ``ds``'s small files (at most ``cache.pack_threshold`` bytes) to ``to_url``
    and verify it against the manifest. Files are read from the origin, not through (or into) the cache."""
    import pyarrow as pa

    to_url = to_url.rstrip("/")
    target = engine.source_for(to_url)
    summary = MirrorSummary(to_url)
    t0 = time.perf_counter()
    files = []
    for e in ds.walk_files():
        if e.size and engine.small.packable(e):
            files.append(e)
        elif e.size:
            summary.skipped_large += 1
    files.sort(key=lambda e: e.path)
    groups, group, size = [], [], 0
    for e in files:
        if group and size + e.size > engine.config.cache.pack_size:
            groups.append(group)
            group, size = [], 0
        group.append(e)
        size += e.size
    if group:
        groups.append(group)

    rows: dict[str, list] = {name: [] for name in _index_schema().names}
    packs = []
    for number, group in enumerate(groups):
        datas = await asyncio.gather(*(engine.small.fetch_whole(ds, e) for e in group))
        members = [Member(object_key(ds.ref.id, e.path, e.version), e.path, e.version, block_checksum(d), d)
                   for e, d in zip(group, datas, strict=True)]
        view, placed = serialize(members)
        name = f"packs/p{number:06d}.arrow"
        written = await target.write(f"{to_url}/{name}", bytes(view))
        packs.append({"name": name, "size": written.size, "version": written.version})
        for e, (_okey, offset, length, checksum) in zip(group, placed, strict=True):
            for col, value in (("path", e.path), ("version", e.version), ("size", e.size), ("pack", number),
                               ("offset", offset), ("length", length), ("checksum", checksum)):
                rows[col].append(value)
        summary.files += len(group)
        summary.bytes += sum(e.size for e in group)
        summary.packs += 1
        if on_progress:
            on_progress(summary)
    table = pa.table(rows, schema=_index_schema())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    index = await target.write(f"{to_url}/index.arrow", sink.getvalue().to_pybytes())
    meta = {"format": FORMAT, "source": ds.ref.url, "manifest_version": ds.version, "created": time.time(),
            "files": summary.files, "bytes": summary.bytes, "packs": packs,
            "index": {"name": "index.arrow", "size": index.size, "version": index.version}}
    await target.write(f"{to_url}/mirror.json", json.dumps(meta, indent=1).encode())

    loaded = await load_mirror(engine, ds, to_url, source=target)  # verify: read it back as a reader would
    if loaded is None or len(loaded.entries) != summary.files:
        raise CacheFSError(f"{to_url}: the mirror just written does not read back ({summary.files} files packed)")
    missing = [e.path for e in files if object_key(ds.ref.id, e.path, e.version) not in loaded.entries]
    if missing:
        raise CacheFSError(f"{to_url}: {len(missing)} files of the manifest are not in the mirror (e.g. {missing[0]})")
    for (pack_url, version), meta_pack in zip(loaded.packs, packs, strict=True):
        st = await target.stat(pack_url)
        if st.size != meta_pack["size"] or (version and st.version != version):
            raise CacheFSError(f"{pack_url}: {st.size} bytes on the store, {meta_pack['size']} written")
    summary.verified = True
    summary.seconds = time.perf_counter() - t0
    return summary


async def load_mirror(engine: Engine, ds: Dataset, url: str | None = None, *, source: Source | None = None
                      ) -> MirrorIndex | None:
    """The mirror of ``ds`` at ``url`` (default ``<dataset URL>.cachefs``), or None if there is none (or it is
    of another dataset, another format, or incomplete)."""
    import pyarrow as pa

    url = (url or mirror_url_for(ds.ref.url)).rstrip("/")
    src = source or engine.source_for(url)
    try:
        st = await src.stat(f"{url}/mirror.json")
    except ObjectNotFoundError:
        return None
    meta = json.loads(await src.read(f"{url}/mirror.json", st.version, 0, st.size))
    if meta.get("format") != FORMAT or meta.get("source", "").rstrip("/") != ds.ref.url.rstrip("/"):
        log.warning("%s: not a mirror of %s in format %d; ignored", url, ds.ref.url, FORMAT)
        return None
    idx = meta["index"]
    raw = await src.read(f"{url}/{idx['name']}", idx.get("version", ""), 0, int(idx["size"]))
    table = pa.ipc.open_file(pa.py_buffer(raw)).read_all()
    mirror = MirrorIndex(url, [(f"{url}/{p['name']}", p.get("version", "")) for p in meta["packs"]],
                         [int(p["size"]) for p in meta["packs"]])
    mirror.layout = [[] for _ in mirror.packs]
    cols = [table.column(n).to_pylist() for n in ("path", "version", "pack", "offset", "length", "checksum")]
    for path, version, pack, offset, length, checksum in zip(*cols, strict=True):
        okey = object_key(ds.ref.id, path, version)
        mirror.entries[okey] = (pack, offset, length, checksum)
        mirror.layout[pack].append((offset, length, okey, checksum, path, version))
    for members in mirror.layout:
        members.sort()
    return mirror

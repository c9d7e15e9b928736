"""``cachefs pack``: write a dataset's packed mirror (the format is :mod:`cachefs.formats.mirror_index`) next to it.

The dataset's small files (at most ``cache.pack_threshold`` bytes) are read from the origin, not through (or
into) the cache, grouped in path order into packs of about ``cache.pack_size``, written as pack objects plus an
index, and the whole is read back and checked against the manifest before the job says it is done.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CacheFSError
from cachefs.base.types import Entry, object_key
from cachefs.engine import Engine
from cachefs.formats.mirror_index import FORMAT, index_schema
from cachefs.formats.pack_file import Member, serialize
from cachefs.manifest.dataset import Dataset
from cachefs.tiers.mirror import load_mirror

__all__ = ["MirrorSummary", "write_mirror"]


@dataclass
class MirrorSummary:
    url: str
    files: int = 0
    bytes: int = 0
    packs: int = 0
    skipped_large: int = 0
    seconds: float = 0.0
    verified: bool = False


async def _origin_bytes(engine: Engine, ds: Dataset, entry: Entry) -> bytes:
    """The whole object from the origin, within the funnel's limits (memory, GETs, wire)."""
    async with await engine.funnel.hold(entry.size):
        data = await engine.funnel.get(ds.source, ds.object_url(entry), entry.version, 0, entry.size)
    return data if type(data) is bytes else bytes(data)


async def write_mirror(engine: Engine, ds: Dataset, to_url: str, *,
                       on_progress: Callable[[MirrorSummary], None] | None = None) -> MirrorSummary:
    """Write the packed mirror of ``ds``'s small files to ``to_url`` and verify it against the manifest."""
    import pyarrow as pa

    to_url = to_url.rstrip("/")
    target = ds.source if to_url.split("://", 1)[0] == ds.ref.url.split("://", 1)[0] else engine.source_for(to_url)
    summary = MirrorSummary(to_url)
    t0 = time.perf_counter()
    files = []
    for e in ds.walk_files():
        if e.size and engine.strategy(e).packed:
            files.append(e)
        elif e.size:
            summary.skipped_large += 1
    files.sort(key=lambda e: e.path)
    groups: list[list[Entry]] = []
    group: list[Entry] = []
    size = 0
    for e in files:
        if group and size + e.size > engine.config.cache.pack_size:
            groups.append(group)
            group, size = [], 0
        group.append(e)
        size += e.size
    if group:
        groups.append(group)

    rows: dict[str, list] = {name: [] for name in index_schema().names}
    packs = []
    for number, group in enumerate(groups):
        datas = await asyncio.gather(*(_origin_bytes(engine, ds, e) for e in group))
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
    table = pa.table(rows, schema=index_schema())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    index = await target.write(f"{to_url}/index.arrow", sink.getvalue().to_pybytes())
    meta = {"format": FORMAT, "source": ds.ref.url, "manifest_version": ds.version, "created": time.time(),
            "files": summary.files, "bytes": summary.bytes, "packs": packs,
            "index": {"name": "index.arrow", "size": index.size, "version": index.version}}
    await target.write(f"{to_url}/mirror.json", json.dumps(meta, indent=1).encode())

    loaded = await load_mirror(ds.ref, target, to_url)  # verify: read it back as a reader would
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

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
    pack files in the node's own format (:mod:`cachefs.formats.pack_file`): files in path order, so a directory's
    files sit together. A node installs a pack it fetches as it is (:mod:`cachefs.tiers.mirror`).
``index.arrow``
    an Arrow IPC file with one row per packed file: ``path``, ``version`` (the source's ETag/version when
    packed), ``size``, ``pack`` (position in ``packs``), ``offset``, ``length``, ``checksum`` (xxh3-64).

Staleness is per file: a reader looks a file up under the version its manifest names, so a file changed at
the source since the mirror was written simply has no mirror entry and is read from the source; the rest
still come from the mirror. The pack objects are read pinned to the version recorded for them, so a mirror
rewritten under a reader fails its reads (and the reader falls back to the source) instead of mixing bytes.

This module is the format: parsing a mirror's files (:func:`parse_meta`, :func:`parse_index`). ``cachefs pack``
writes one (:mod:`cachefs.jobs.write_mirror`); the mirror tier reads one through the dataset's source
(:func:`cachefs.tiers.mirror.load_mirror`) and fetches from it.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass, field

from cachefs.base.errors import CacheFSError
from cachefs.base.types import DatasetRef, object_key

__all__ = ["FORMAT", "MIRROR_SUFFIX", "MirrorIndex", "MirrorWindow", "index_schema", "mirror_url_for", "parse_index",
           "parse_meta"]

log = logging.getLogger(__name__)

MIRROR_SUFFIX = ".cachefs"
FORMAT = 1


def mirror_url_for(url: str) -> str:
    return url.rstrip("/") + MIRROR_SUFFIX


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


@dataclass(frozen=True, slots=True)
class MirrorWindow:
    """One window of a mirror pack as fetched (``data``, bytes ``[start, start + len(data))`` of pack ``pack``, which
    is ``pack_size`` bytes fetched in ``windows`` windows), with the members that the reader's manifest names:
    (object key, offset in the pack, length, xxh3), each verified."""

    ds_id: str
    pack: int
    pack_size: int
    windows: int
    window: int
    start: int
    data: bytes | bytearray
    members: tuple[tuple[bytes, int, int, int], ...]

    def member(self, okey: bytes) -> bytes | bytearray | None:
        """The bytes of member ``okey``, if the window holds it."""
        for key, offset, length, _checksum in self.members:
            if key == okey:
                return self.data[offset - self.start:offset - self.start + length]
        return None


def index_schema():
    """The columns of ``index.arrow``."""
    import pyarrow as pa

    return pa.schema([("path", pa.string()), ("version", pa.string()), ("size", pa.uint64()), ("pack", pa.uint32()),
                      ("offset", pa.uint64()), ("length", pa.uint64()), ("checksum", pa.uint64())])


def _damage(url: str, exc: Exception) -> CacheFSError:
    return CacheFSError(f"{url}: the mirror is damaged ({type(exc).__name__}: {exc})")


def parse_meta(ref: DatasetRef, url: str, raw: bytes | bytearray) -> dict | None:
    """``mirror.json`` of a mirror of ``ref``: None if it is of another dataset or format; CacheFSError if it is
    damaged."""
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise TypeError("not an object")
        if meta.get("format") != FORMAT or str(meta.get("source", "")).rstrip("/") != ref.url.rstrip("/"):
            log.warning("%s: not a mirror of %s in format %d; ignored", url, ref.url, FORMAT)
            return None
        idx = meta["index"]
        meta["index"] = {"name": str(idx["name"]), "version": str(idx.get("version", "")), "size": int(idx["size"])}
        meta["packs"] = [{"name": str(p["name"]), "version": str(p.get("version", "")), "size": int(p["size"])}
                         for p in meta["packs"]]
        if meta["index"]["size"] < 0 or any(p["size"] < 0 for p in meta["packs"]):
            raise ValueError("negative size")
        return meta
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _damage(url, exc) from None


def parse_index(ref: DatasetRef, url: str, meta: dict, raw: bytes | bytearray) -> MirrorIndex:
    """The mirror's index (Arrow IPC) as a :class:`MirrorIndex`; CacheFSError if it is damaged (a member outside
    its pack included)."""
    import pyarrow as pa

    try:
        return _parse_index(ref, url, meta, raw)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, OSError, pa.ArrowException) as exc:
        raise _damage(url, exc) from None


def _parse_index(ref: DatasetRef, url: str, meta: dict, raw: bytes | bytearray) -> MirrorIndex:
    import pyarrow as pa

    table = pa.ipc.open_file(pa.py_buffer(raw)).read_all()
    table.validate(full=True)  # damaged offsets would otherwise reach to_pylist (a SystemError in pyarrow)
    sizes = [int(p["size"]) for p in meta["packs"]]
    mirror = MirrorIndex(url, [(f"{url}/{p['name']}", p["version"]) for p in meta["packs"]], sizes)
    mirror.layout = [[] for _ in mirror.packs]
    cols = [table.column(n).to_pylist() for n in ("path", "version", "pack", "offset", "length", "checksum")]
    for path, version, pack, offset, length, checksum in zip(*cols, strict=True):
        if not (0 <= pack < len(sizes) and 0 <= offset and 0 <= length and offset + length <= sizes[pack]):
            raise ValueError(f"{path!r} lies outside its pack")
        okey = object_key(ref.id, path, version)
        mirror.entries[okey] = (pack, offset, length, checksum)
        mirror.layout[pack].append((offset, length, okey, checksum, path, version))
    for members in mirror.layout:
        members.sort()
    return mirror

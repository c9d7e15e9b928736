"""Binary layouts of the index records (documented in docs/FORMAT.md; pinned by tests/unit/test_format.py)."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field

__all__ = ["BLOCK", "DIR_HEAT", "DS_STATS", "EVICTED", "FORMAT_VERSION", "PACKED", "TOTALS", "DatasetRecord",
           "DatasetStats", "ManifestInfo", "ObjectRecord", "PackRecord"]

#: Bump when any record layout or the data-file layout changes; an index of another version is refused.
FORMAT_VERSION = 2

#: blocks: key = object key (16 B) + block index (u32 BE); value = xxh3-64 checksum, length.
BLOCK = struct.Struct("<QI")
#: ds_stats: key = dataset id; value = cached bytes, hit bytes, miss bytes.
DS_STATS = struct.Struct("<QQQ")
#: meta b"totals": cached bytes over all datasets, number of cached objects.
TOTALS = struct.Struct("<QQ")
#: meta b"evicted": objects and packs evicted since the index was made, and the bytes they held.
EVICTED = struct.Struct("<QQ")
_OBJECT = struct.Struct("<QQdQI")
#: packed: key = object key (16 B); value = pack id, offset of the member's bytes in the pack file, length,
#: xxh3-64 of the member.
PACKED = struct.Struct("<QQQQ")
#: dir_heat: key = dataset id + directory path (UTF-8); value = decayed access score, when it was last updated.
DIR_HEAT = struct.Struct("<dd")
_PACK = struct.Struct("<QQIdQ")


@dataclass(slots=True)
class ObjectRecord:
    """One cached object version: which dataset and path it is, its size, and access statistics."""

    dataset: str
    path: str
    version: str
    size: int
    cached_bytes: int = 0
    last_access: float = 0.0
    hits: int = 0
    block_size: int = 0

    def pack(self) -> bytes:
        head = _OBJECT.pack(self.size, self.cached_bytes, self.last_access, self.hits, self.block_size)
        return head + b"\0".join(s.encode() for s in (self.dataset, self.path, self.version))

    @classmethod
    def unpack(cls, raw: bytes) -> ObjectRecord:
        size, cached, last, hits, bs = _OBJECT.unpack_from(raw)
        dataset, path, version = bytes(raw[_OBJECT.size:]).decode().split("\0", 2)
        return cls(dataset, path, version, size, cached, last, hits, bs)


@dataclass(slots=True)
class PackRecord:
    """One pack file: its size on disk, the bytes of the members the index points into it (live), and access
    statistics (so that eviction ranks packs exactly like objects)."""

    dataset: str
    pack_id: int
    size: int
    live_bytes: int
    members: int
    last_access: float = 0.0
    hits: int = 0

    def key(self) -> bytes:
        return pack_key(self.dataset, self.pack_id)

    def pack(self) -> bytes:
        return _PACK.pack(self.size, self.live_bytes, self.members, self.last_access, self.hits)

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> PackRecord:
        size, live, members, last, hits = _PACK.unpack(raw)
        return cls(bytes(key[:16]).decode(), int.from_bytes(key[16:24], "big"), size, live, members, last, hits)


def pack_key(dataset: str, pack_id: int) -> bytes:
    """packs: key = dataset id (16 ASCII) + pack id (u64 BE); pack_members: that key + member object key."""
    return dataset.encode() + pack_id.to_bytes(8, "big")


@dataclass
class ManifestInfo:
    version: int
    created: float
    files: int
    bytes: int
    skipped: int = 0
    #: The largest file's size (None: a manifest written before this was recorded).
    largest: int | None = None


@dataclass
class DatasetRecord:
    """What the node knows about a dataset: its URL and manifest versions (the newest is ``current``)."""

    id: str
    url: str
    current: int = 0
    manifests: list[ManifestInfo] = field(default_factory=list)

    def manifest(self, version: int | None = None) -> ManifestInfo | None:
        want = self.current if version is None else version
        return next((m for m in self.manifests if m.version == want), None)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> DatasetRecord:
        d = json.loads(bytes(raw))
        d["manifests"] = [ManifestInfo(**m) for m in d.get("manifests", [])]
        return cls(**d)


@dataclass(frozen=True)
class DatasetStats:
    cached_bytes: int
    hit_bytes: int
    miss_bytes: int

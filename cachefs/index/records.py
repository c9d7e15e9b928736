"""Binary layouts of the index records (documented in docs/FORMAT.md; pinned by tests/unit/test_format.py)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["BLOCK", "DS_STATS", "FORMAT_VERSION", "TOTALS", "ObjectRecord"]

#: Bump when any record layout or the data-file layout changes; an index of another version is refused.
FORMAT_VERSION = 1

#: blocks: key = object key (16 B) + block index (u32 BE); value = xxh3-64 checksum, length.
BLOCK = struct.Struct("<QI")
#: ds_stats: key = dataset id; value = cached bytes, hit bytes, miss bytes.
DS_STATS = struct.Struct("<QQQ")
#: meta b"totals": cached bytes over all datasets, number of cached objects.
TOTALS = struct.Struct("<QQ")
_OBJECT = struct.Struct("<QQdQI")


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

"""Block checksums: xxh3-64, chosen because it hashes at memory speed (tens of GB/s), so verifying every
block read from disk costs a few percent of an NVMe read."""

from __future__ import annotations

import xxhash

__all__ = ["block_checksum", "block_hasher"]


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """The 64-bit checksum stored in the index for a block's bytes."""
    return xxhash.xxh3_64_intdigest(data)


def block_hasher() -> xxhash.xxh3_64:
    """An incremental :func:`block_checksum`: ``update`` it with a block's bytes in pieces, then ``intdigest``."""
    return xxhash.xxh3_64()

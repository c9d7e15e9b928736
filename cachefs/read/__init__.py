"""The two read strategies, chosen once per file when it is opened: large objects in blocks
(:mod:`.blocks`), small ones packed (:mod:`.packs`)."""

from cachefs.read.blocks import BlockFile, BlockPath
from cachefs.read.packs import PackedFile, PackPath
from cachefs.read.stream import OpenFile, ReadStream

__all__ = ["BlockFile", "BlockPath", "OpenFile", "PackPath", "PackedFile", "ReadStream"]

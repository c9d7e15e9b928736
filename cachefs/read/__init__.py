"""The two read strategies, chosen once per file when it is opened: large objects in blocks
(:mod:`.blocks`), small ones packed (:mod:`.packs`)."""

from .blocks import BlockFile, BlockPath
from .packs import PackedFile, PackPath
from .stream import OpenFile, ReadStream

__all__ = ["BlockFile", "BlockPath", "OpenFile", "PackPath", "PackedFile", "ReadStream"]

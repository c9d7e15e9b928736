"""The two read strategies, chosen once per file (:meth:`Engine.strategy <cachefs.engine.Engine.strategy>`): large
objects in blocks (:mod:`.block_strategy`), small ones whole in packs (:mod:`.pack_strategy`)."""

from cachefs.read.base import WOULD_WAIT, LocalRead, OpenFile, ReadStrategy, ReadStream
from cachefs.read.block_file import BlockFile
from cachefs.read.block_strategy import BlockStrategy
from cachefs.read.pack_strategy import PackedFile, PackStrategy

__all__ = ["WOULD_WAIT", "BlockFile", "BlockStrategy", "LocalRead", "OpenFile", "PackStrategy", "PackedFile",
           "ReadStrategy", "ReadStream"]

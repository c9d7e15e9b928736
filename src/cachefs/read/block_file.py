"""A large file open through the block read strategy (:mod:`.block_strategy`): reads go to the strategy, a pinned
complete cache file is read directly."""

from __future__ import annotations

import os
from typing import Protocol

from cachefs.base.types import Entry, object_key
from cachefs.manifest.dataset import Dataset
from cachefs.node.open_objects import OpenObject, OpenObjects
from cachefs.read.base import OpenFile, ReadStream

__all__ = ["BlockFile", "BlockReads"]


class BlockReads(Protocol):
    """What a block file asks of its strategy (:class:`~.block_strategy.BlockStrategy`)."""

    objects: OpenObjects

    def read_whole(self, ob: OpenObject, ds: Dataset, start: int, end: int, stream: ReadStream) -> bytes: ...

    def read_local(self, ds: Dataset, entry: Entry, start: int, end: int, stream: ReadStream | None,
                   okey: bytes | None = None) -> bytes | None: ...

    async def read(self, ds: Dataset, entry: Entry, start: int, end: int, stream: ReadStream | None,
                   okey: bytes | None = None) -> bytes: ...

    def count(self, ob: OpenObject, ds_id: str, stream: ReadStream | None, hit: int = 0, miss: int = 0) -> None: ...


class BlockFile(OpenFile):
    """A large file, read in blocks. With ``stream`` None (a one-off read) every read is an access of its own
    and starts no read-ahead."""

    packed = False

    def __init__(self, strategy: BlockReads, ds: Dataset, entry: Entry, pin: OpenObject | None,
                 stream: ReadStream | None) -> None:
        self.strategy, self.ds, self.entry, self.pin, self.stream = strategy, ds, entry, pin, stream
        self.okey = pin.key if pin is not None else object_key(ds.ref.id, entry.path, entry.version)

    def read_local(self, start: int, end: int, *, wait: bool = True) -> bytes | None:
        end = min(end, self.entry.size)
        if start >= end:
            return b""
        ob = self.pin
        if ob is not None and ob.whole and self.stream is not None:  # the warm read's path: straight to the file
            return self.strategy.read_whole(ob, self.ds, start, end, self.stream)
        return self.strategy.read_local(self.ds, self.entry, start, end, self.stream, self.okey)

    async def read(self, start: int, end: int) -> bytes:
        end = min(end, self.entry.size)
        if start >= end:
            return b""
        return await self.strategy.read(self.ds, self.entry, start, end, self.stream, self.okey)

    def read_by_kernel(self) -> None:
        ob = self.pin
        if ob is not None:
            self.strategy.count(ob, self.ds.ref.id, self.stream, hit=self.entry.size)

    def local_fd(self) -> int | None:
        """A new descriptor of the pinned, complete cache file (a descriptor, not a path eviction could swap)."""
        ob = self.pin
        if ob is None or not self.strategy.objects.complete(ob):
            return None
        return os.open(f"/proc/self/fd/{ob.stored.fileno()}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        pin, self.pin = self.pin, None
        if pin is not None:
            self.strategy.objects.unpin(pin)

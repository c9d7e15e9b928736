"""What a reader has open: one file of a dataset, read through the strategy chosen for it when it was opened."""

from __future__ import annotations

import abc
from dataclasses import dataclass

__all__ = ["OpenFile", "ReadStream"]


@dataclass
class ReadStream:
    """Per-open-file read state: where the last read ended and how far ahead to fetch."""

    next_offset: int = 0
    window: int = 0  # blocks
    #: Whether this stream's access was counted yet (an object's hit count is the number of accesses, i.e.
    #: opens, not of read calls, so a file read in many small reads is still one access).
    counted: bool = False
    #: Blocks below this index were already handed to read-ahead from a local read (see BlockPath._keep_ahead).
    ahead_to: int = 0
    #: (object key, bytes) of the packed file this stream reads in pieces: a packed file is read and verified
    #: whole, so each later piece is a slice of it, not another read and checksum of the whole member (the
    #: kernel asks for a page-cached file in read-ahead pieces of 128 KiB: 8 whole reads of a 1 MiB file).
    member: tuple[bytes, bytes] | None = None
    #: (object key, block, its pieces) of the block this stream is reading through: read and verified whole at
    #: the stream's first read in it, so that the next reads are its pieces, not reads of the block again.
    block: tuple[bytes, int, list[bytes]] | None = None


class OpenFile(abc.ABC):
    """One file opened for reading (``Engine.open``): a large object read in blocks, or a small one packed."""

    #: Whether this is a packed small file (never passthrough: its bytes sit inside a pack).
    packed: bool

    @abc.abstractmethod
    def read_local(self, start: int, end: int, *, wait: bool = True) -> bytes | bytearray | object | None:
        """``[start, end)`` from this node, from the calling thread; None if anything is missing (then await
        :meth:`read`). Without ``wait``, WOULD_WAIT if the bytes are here but reading them would wait on the
        disk (call again from a thread that may wait)."""

    @abc.abstractmethod
    async def read(self, start: int, end: int) -> bytes | bytearray:
        """``[start, end)``, fetching what is missing (on the cachefs event loop)."""

    def local_fd(self) -> int | None:
        """A new read-only descriptor of the complete local file (for FUSE passthrough), or None."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """The reader closed the file (eviction may take it now)."""

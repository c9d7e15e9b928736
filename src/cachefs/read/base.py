"""What the two read strategies have in common: the strategy itself (:class:`ReadStrategy`, chosen once per file by
:meth:`Engine.strategy <cachefs.engine.Engine.strategy>`), the file a reader has open through it (:class:`OpenFile`)
and that reader's state (:class:`ReadStream`)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

from cachefs.base.types import Entry
from cachefs.formats.pack_file import WOULD_WAIT, MemberRead
from cachefs.manifest.dataset import Dataset
from cachefs.prefetch.prefetcher import Hint

__all__ = ["WOULD_WAIT", "LocalRead", "OpenFile", "ReadStrategy", "ReadStream"]

#: What a read from this node answers from the calling thread: the bytes; None when some are missing (then fetch
#: them); WOULD_WAIT when they are here but reading them would wait on the disk (then read from a thread that may
#: wait).
LocalRead: TypeAlias = "bytes | bytearray | Literal[MemberRead.WOULD_WAIT] | None"


@dataclass
class ReadStream:
    """Per-open-file read state: where the last read ended and how far ahead to fetch."""

    next_offset: int = 0
    window: int = 0  # blocks
    #: Whether this stream's access was counted yet (an object's hit count is the number of accesses, i.e.
    #: opens, not of read calls, so a file read in many small reads is still one access).
    counted: bool = False
    #: Blocks below this index were already handed to read-ahead from a local read (BlockStrategy.keep_ahead).
    ahead_to: int = 0
    #: (object key, bytes) of the packed file this stream reads in pieces: a packed file is read and verified
    #: whole, so each later piece is a slice of it, not another read and checksum of the whole member (the
    #: kernel asks for a page-cached file in read-ahead pieces of 128 KiB: 8 whole reads of a 1 MiB file).
    member: tuple[bytes, bytes | bytearray] | None = None
    #: (object key, block, its pieces) of the block this stream is reading through: read and verified whole at
    #: the stream's first read in it, so that the next reads are its pieces, not reads of the block again.
    block: tuple[bytes, int, list[bytes]] | None = None


class OpenFile(abc.ABC):
    """One file opened for reading (``Engine.open``): a large object read in blocks, or a small one packed."""

    #: Whether this is a packed small file (never passthrough: its bytes sit inside a pack).
    packed: bool

    @abc.abstractmethod
    def read_local(self, start: int, end: int, *, wait: bool = True) -> LocalRead:
        """``[start, end)`` from this node, from the calling thread; None if anything is missing (then await
        :meth:`read`). Without ``wait``, WOULD_WAIT if the bytes are here but reading them would wait on the
        disk (call again from a thread that may wait)."""

    @abc.abstractmethod
    async def read(self, start: int, end: int) -> bytes | bytearray:
        """``[start, end)``, fetching what is missing (on the cachefs event loop)."""

    def local_fd(self) -> int | None:
        """A new read-only descriptor of the complete local file (for FUSE passthrough), or None."""
        return None

    def read_by_kernel(self) -> None:  # noqa: B027 - optional hook
        """The kernel reads this file from its local file itself from now on (FUSE passthrough), unseen here: count
        it as one access whose bytes are all hits (what a reader of a passthrough file reads cannot be known)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The reader closed the file (eviction may take it now)."""


class ReadStrategy(abc.ABC):
    """How one kind of file is read, kept and served: large objects in blocks, small ones whole in packs. The
    engine asks which applies once per file (:meth:`Engine.strategy <cachefs.engine.Engine.strategy>`)."""

    #: Whether files of this strategy are packed small files (never passthrough: their bytes sit inside a pack).
    packed: bool

    @abc.abstractmethod
    def open(self, ds: Dataset, entry: Entry, *, pin: bool = True) -> OpenFile:
        """A reader opens ``entry`` (with ``pin``, eviction by any process leaves its file alone until closed)."""

    @abc.abstractmethod
    def oneoff(self, ds: Dataset, entry: Entry, stream: ReadStream | None) -> OpenFile:
        """A file for one read (``stream`` None: no read-ahead, the read is an access of its own)."""

    @abc.abstractmethod
    async def ensure(self, ds: Dataset, entry: Entry, on_bytes: Callable[[int], None] | None = None) -> None:
        """Make ``entry`` wholly present on purpose (a prefetch job: neither a hit nor a miss, not read-ahead);
        CacheFullError when the disk cannot take it. ``on_bytes(n)`` as pieces land."""

    @abc.abstractmethod
    def ahead_hints(self, ds: Dataset, entry: Entry) -> list[Hint]:
        """Work that fetches what is missing of ``entry`` for a reader that will open it soon (a declared order,
        counted as read-ahead; what the disk does not keep waits in memory for the reader)."""

    @abc.abstractmethod
    def cached_bytes(self, ds: Dataset, entry: Entry, okey: bytes) -> int:
        """Bytes of ``entry`` on this node."""

    def local_path(self, ds: Dataset, entry: Entry) -> str | None:
        """Path of ``entry``'s complete local file of its own, or None."""
        return None

    @abc.abstractmethod
    async def serve(self, ds: Dataset, entry: Entry, block: int | None, *, fetch: bool) -> tuple[bytes, int] | None:
        """Block ``block`` of ``entry`` (None: the whole small file) for a member of the cache group, with its xxh3:
        from this node, or with ``fetch`` (this node owns the key) fetched first; None otherwise."""

    @abc.abstractmethod
    def stop(self) -> list:
        """Stop starting work; the fetches in flight (for the caller to cancel and await)."""

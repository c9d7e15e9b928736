"""Where cached bytes live on this node.

A :class:`BlockStore` keeps one local file per cached object version, laid out exactly like the object
(block ``i`` at offset ``i × block_size``), so that a fully cached object *is* a complete local file the
FUSE layer can hand to the kernel for passthrough. Which blocks of a file hold data is the index's
business, not the store's: the store writes and reads bytes, verifies them against the checksum it is
given, and refuses to delete a file while any process has it open.

A :class:`PackStore` keeps small objects many to a file (:mod:`cachefs.formats.pack_file`), each pack written once,
crash-safely, and removed whole.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cachefs.formats.pack_file import Member

__all__ = ["BlockStore", "PackStore", "StoredObject", "WrittenPack"]


class StoredObject(abc.ABC):
    """An open local file of one object version. Evictors skip it while it is held (:meth:`hold`)."""

    key: bytes
    size: int
    #: Path of the local file (complete once every block is present).
    path: str

    @abc.abstractmethod
    def write_block(self, idx: int, data: bytes | bytearray) -> None:
        """Store block ``idx``. Raises CacheFullError when the disk is full."""

    @abc.abstractmethod
    def read(self, start: int, end: int, checksums: dict[int, tuple[int, int]]) -> bytes:
        """Bytes ``[start, end)``; every block they touch must be in ``checksums`` (idx → (xxh3, length)).

        Each block is verified against its checksum the first time this handle reads it; a mismatch raises
        CorruptBlockError naming the block (``err.block``)."""

    @abc.abstractmethod
    def verified(self, idx: int) -> bool:
        """Whether block ``idx`` was verified through this handle already."""

    @abc.abstractmethod
    def all_verified(self, nblocks: int) -> bool:
        """Whether every one of the object's ``nblocks`` blocks was verified through this handle."""

    @abc.abstractmethod
    def read_verified(self, start: int, end: int) -> bytes:
        """``[start, end)``, from blocks this handle verified already."""

    @abc.abstractmethod
    def read_block(self, idx: int, expected: tuple[int, int]) -> list[bytes]:
        """Block ``idx`` whole and verified (``expected``: its xxh3 and length), in the pieces it was read in;
        CorruptBlockError if it fails."""

    @abc.abstractmethod
    def forget_verified(self, idx: int) -> None:
        """Verify block ``idx`` again on its next read (it was dropped and will be rewritten)."""

    @abc.abstractmethod
    def drop_block(self, idx: int) -> None:
        """Free the space of block ``idx`` (written, but not recorded in the index)."""

    @abc.abstractmethod
    def hold(self) -> bool:
        """Keep evictors off the file until :meth:`unhold`; False (nothing held) if it was evicted already."""

    @abc.abstractmethod
    def unhold(self) -> None:
        """Let evictors take the file again."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """The open descriptor of the file."""

    @abc.abstractmethod
    def linked(self) -> bool:
        """Whether the file is still the object's cache file (an evicted one reads on, but is not written)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the file (and any hold)."""


class BlockStore(abc.ABC):
    """The local tier: one file per object version, opened shared, evicted exclusively."""

    block_size: int

    @abc.abstractmethod
    def open(self, key: bytes, dataset: str, size: int) -> StoredObject:
        """Open (creating if needed) the file of an object version for reading and writing."""

    @abc.abstractmethod
    def try_remove(self, key: bytes, dataset: str, on_locked) -> bool:
        """Remove an object's file if no process holds it. ``on_locked()`` runs while the exclusive lock is
        held, before the file disappears (the index forgets the object there); returning False keeps the
        file. Returns whether the file was removed."""

    @abc.abstractmethod
    def try_keep_only(self, key: bytes, dataset: str, keep, on_locked) -> bool:
        """Replace an object's file, if no process holds it, by one holding only the blocks ``keep()`` names
        (called under the exclusive lock, when no block is being written; none: the file goes); the rest give
        their space back. ``on_locked()`` runs under the exclusive lock once the new file is written, before it
        takes the old one's place (the index forgets the other blocks there); returning False keeps the old
        file. A descriptor opened before reads on from the old file, whole for every block it knew, and
        :meth:`StoredObject.linked` tells it the file is no longer the cache's. Returns whether it was done."""

    @abc.abstractmethod
    def disk_usage(self) -> tuple[int, int]:
        """(total, free) bytes of the filesystem holding the store."""


@dataclass(frozen=True)
class WrittenPack:
    pack_id: int
    size: int
    #: (object key, offset of the bytes in the file, length, checksum) per member
    members: list[tuple[bytes, int, int, int]]


class PackStore(abc.ABC):
    """Pack files of small objects, per dataset. A pack is filled in a temp file and published whole (never a
    half-written pack under its name); only then may the index name it."""

    @abc.abstractmethod
    def pack_path(self, dataset: str, pack_id: int) -> str:
        """Where pack ``pack_id`` of ``dataset`` lives once published."""

    @abc.abstractmethod
    def write(self, dataset: str, members: list[Member]) -> WrittenPack:
        """Write ``members`` as one new pack (crash-safely) and return where each member's bytes are."""

    @abc.abstractmethod
    def begin(self, dataset: str) -> tuple[int, str, int]:
        """A new pack's id, and its temp file (path, writable descriptor): fill it with :meth:`write_at`, then
        :meth:`publish` it (or :meth:`abandon` it)."""

    @abc.abstractmethod
    def write_at(self, fd: int, data: bytes | bytearray | memoryview, offset: int, tmp: str) -> None:
        """Write all of ``data`` at ``offset`` of the temp file ``tmp`` (open as ``fd``); CacheFullError when the
        disk is full, CacheFSError for any other failure."""

    @abc.abstractmethod
    def publish(self, dataset: str, pack_id: int, tmp: str, fd: int) -> None:
        """Make a filled temp file the pack ``pack_id``, durably; closes ``fd``."""

    @abc.abstractmethod
    def abandon(self, tmp: str, fd: int) -> None:
        """Drop an unpublished temp file (closes ``fd``)."""

    @abc.abstractmethod
    def open(self, dataset: str, pack_id: int) -> int | None:
        """A read-only descriptor of the pack, or None if it is gone (evicted)."""

    @abc.abstractmethod
    def remove(self, dataset: str, pack_id: int) -> None:
        """Remove a pack (readers that have it open read on)."""

    @abc.abstractmethod
    def files(self) -> Iterable[tuple[str, int, str]]:
        """(dataset, pack id, path) of every published pack."""

    @abc.abstractmethod
    def clean(self, known: Callable[[str, int], bool]) -> int:
        """Remove temp files of writers that are gone and old packs ``known(dataset, pack_id)`` says the index never
        learnt of; how many files went."""

"""Where cached bytes live on this node: large objects block by block in files of their own, small ones in packs."""

from cachefs.store.base import BlockStore, PackStore, StoredObject, WrittenPack
from cachefs.store.disk import DiskObject, DiskStore
from cachefs.store.pack_store import DiskPackStore

__all__ = ["BlockStore", "DiskObject", "DiskPackStore", "DiskStore", "PackStore", "StoredObject", "WrittenPack"]

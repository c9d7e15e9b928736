"""The local store (NVMe tier)."""

from cachefs.store.base import BlockStore, StoredObject
from cachefs.store.disk import DiskObject, DiskStore

__all__ = ["BlockStore", "DiskObject", "DiskStore", "StoredObject"]

"""The local store (NVMe tier)."""

from .base import BlockStore, StoredObject
from .disk import DiskObject, DiskStore

__all__ = ["BlockStore", "DiskObject", "DiskStore", "StoredObject"]

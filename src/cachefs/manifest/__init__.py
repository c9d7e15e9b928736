"""Frozen, versioned dataset manifests."""

from cachefs.manifest.builder import KEEP_VERSIONS, take_snapshot
from cachefs.manifest.store import ManifestStore, ManifestWriter, valid_relpath

__all__ = ["KEEP_VERSIONS", "ManifestStore", "ManifestWriter", "take_snapshot", "valid_relpath"]

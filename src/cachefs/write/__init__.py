"""Writable checkpoint volumes: the write path, a sibling of the read path.

A volume is a directory tree on the node's cache disk (``<cache>/volumes/<id>/tree``) that front doors write into
(:mod:`cachefs.fuse.writable`, the fsspec protocol with ``writable``). A file closed or fsynced there is durable on
this node (its bytes fsynced, a snapshot of it linked into the queue and journalled) and reaches the origin later,
in the order files were closed (:mod:`.queue`, :mod:`.uploader`); a directory renamed onto its final name is
published with a commit record written last (:mod:`.commits`). It shares with the read path only the memory
budget, the disk accounting (the read cache makes room for staged bytes) and the sources.
"""

from cachefs.write.opening import open_volume
from cachefs.write.volume import WritableVolume

__all__ = ["WritableVolume", "open_volume"]

"""The cache group's protocol, in one place for both sides of the wire: the placement keys of what the group
shares (a block, a window of a directory's small files, a dataset's manifest), how many of a key's candidates
fetch it from the origin, and the flag that marks a request made of a member as a replica of a hot key.

The reader's side (:class:`~cachefs.tiers.peer.PeerTier`) and the serving side (the agent's peer server) both
place keys with these functions, so they always agree on who owns what.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from contextvars import ContextVar

from cachefs.manifest.dataset import Dataset

__all__ = ["ASKED_AS_REPLICA", "ASKED_BY", "MANIFEST_CANDIDATES", "OWNERS_THAT_FETCH", "SMALL_WINDOW", "DirectoryWindows",
           "block_key", "manifest_key", "small_key"]

#: A key's first candidates fetch it from the origin when asked (the owner, and the one asked when it fails).
OWNERS_THAT_FETCH = 2
#: Members asked for a dataset's manifest, in rank order.
MANIFEST_CANDIDATES = 4
#: Set while the agent answers a reader that chose this node as a replica of a hot key: what is missing is asked
#: of the key's owners (one origin fetch per group), never straight from the origin first.
ASKED_AS_REPLICA: ContextVar[bool] = ContextVar("asked_as_replica", default=False)
#: Set while the agent answers a member: its name (that member does not hold what it asks for).
ASKED_BY: ContextVar[str] = ContextVar("asked_by", default="")
#: Small files are placed by windows of this many names of their directory (sorted): neighbours, read ahead and
#: packed together, share an owner, and a directory of a million files still spreads over the group.
SMALL_WINDOW = 256


def block_key(okey: bytes, idx: int) -> bytes:
    """The placement key of block ``idx`` of an object version (``okey`` names dataset, object and version)."""
    return b"b" + okey + idx.to_bytes(4, "big")


def small_key(ds_id: str, path: str, window: int) -> bytes:
    """The placement key of a small file: window ``window`` of its directory."""
    return (b"d" + ds_id.encode() + b"/" + path.rpartition("/")[0].encode("utf-8", "surrogateescape") + b"#"
            + window.to_bytes(4, "big"))


def manifest_key(ds_id: str) -> bytes:
    """The placement key of a dataset's manifest: its owner lists the bucket for the group."""
    return b"m" + ds_id.encode()


class DirectoryWindows:
    """The placement key of a small file (:func:`small_key`), from its position in its directory's listing (name
    order) in the reader's manifest version. Kept for the last ``keep`` directories: the first name of each window,
    so that a directory of millions costs a few thousand names."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._firsts: OrderedDict[tuple[str, int, str], list[str]] = OrderedDict()

    def key(self, ds: Dataset, path: str) -> bytes:
        parent, _, name = path.rpartition("/")
        at = (ds.ref.id, ds.version, parent)
        firsts = self._firsts.get(at)
        if firsts is None:
            firsts = self._firsts[at] = _window_firsts(ds, parent)
            if len(self._firsts) > self.keep:
                self._firsts.popitem(last=False)
        else:
            self._firsts.move_to_end(at)
        return small_key(ds.ref.id, path, max(bisect.bisect_right(firsts, name) - 1, 0))


def _window_firsts(ds: Dataset, parent: str) -> list[str]:
    """The first name of each window of directory ``parent``: every SMALL_WINDOW-th in name order."""
    firsts: list[str] = []
    after = None
    while True:
        page = ds.listdir_page(parent, after, SMALL_WINDOW)
        if page:
            firsts.append(page[0].name)
        if len(page) < SMALL_WINDOW:
            return firsts
        after = page[-1].name

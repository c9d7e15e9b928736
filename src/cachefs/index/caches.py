"""Which cache directories this user has on the node, so that a command given no ``--cache-dir`` can find the one
it is about (a mount point's, a written volume's, the only one) or say which exist.

Each cache directory an engine opens is noted in ``$XDG_STATE_HOME/cachefs/caches/`` (``~/.local/state`` when
unset): one small file per directory, named after it, holding its path. A note whose directory holds no cache any
more is dropped when the notes are read. Notes never stop the process writing them (a read-only home is fine).
"""

from __future__ import annotations

import hashlib
import os

from cachefs.base.files import atomic_write

__all__ = ["is_cache", "known_caches", "note_cache"]


def _notes() -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "cachefs", "caches")


def is_cache(path: str) -> bool:
    """Whether ``path`` holds a cache (its index)."""
    return os.path.isfile(os.path.join(path, "index", "data.mdb"))


def note_cache(path: str) -> None:
    """Note ``path`` as a cache directory of this user (best effort)."""
    path = os.path.realpath(path)
    name = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
    note = os.path.join(_notes(), name)
    if os.path.exists(note):
        return
    try:
        os.makedirs(_notes(), mode=0o700, exist_ok=True)
        atomic_write(note, path)
    except OSError:
        pass


def known_caches() -> list[str]:
    """This user's cache directories that still hold a cache, sorted."""
    try:
        names = os.listdir(_notes())
    except OSError:
        return []
    found = set()
    for name in names:
        note = os.path.join(_notes(), name)
        try:
            with open(note, encoding="utf-8", errors="surrogateescape") as f:
                path = f.read().strip()
        except OSError:
            continue
        if path and is_cache(path):
            found.add(path)
        else:
            try:
                os.unlink(note)
            except OSError:
                pass
    return sorted(found)

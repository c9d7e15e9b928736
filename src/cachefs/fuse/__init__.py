"""The FUSE front door: our own implementation of the kernel's FUSE protocol (no libfuse), serving a
dataset's manifest as a read-only tree, cached objects by passthrough, everything else from the engine; and, as a
sibling, writable checkpoint volumes (:mod:`.writable`, :mod:`.volume_mount`).

:func:`hold_mount` mounts and keeps the ``/dev/fuse`` descriptor (:mod:`.holder`); :func:`serve_mount` is the
daemon it runs, which serves the mount until it is unmounted and can be killed and restarted at any time
(:mod:`.serving`). The names below are imported when first asked for: a process that only starts or waits for a
mount (the CLI's background ``cachefs mount``, :mod:`.holder_process`) does not pay for the engine's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachefs.fuse.fs import CacheFS
    from cachefs.fuse.mount import is_stale_mount, unmount
    from cachefs.fuse.serving import hold_mount, serve_mount
    from cachefs.fuse.session import FuseSession
    from cachefs.fuse.volume_mount import serve_writable_mount

__all__ = ["CacheFS", "FuseSession", "hold_mount", "is_stale_mount", "serve_mount", "serve_writable_mount", "unmount"]

_WHERE = {"CacheFS": "fs", "FuseSession": "session", "hold_mount": "serving", "serve_mount": "serving",
          "is_stale_mount": "mount", "unmount": "mount", "serve_writable_mount": "volume_mount"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

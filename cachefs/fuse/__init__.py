"""The FUSE front door: our own implementation of the kernel's FUSE protocol (no libfuse), serving a
dataset's manifest as a read-only tree, cached objects by passthrough, everything else from the engine.

:func:`serve_mount` mounts and serves until unmounted.
"""

from __future__ import annotations

import logging
import os
import threading

from .._aio import run_sync
from ..config import Config
from ..engine import get_engine
from .fs import CacheFS
from .mount import is_stale_mount, mount_fuse, open_fuse_device, unmount
from .registry import forget_mount, record_mount
from .session import FuseSession

__all__ = ["CacheFS", "FuseSession", "is_stale_mount", "serve_mount", "unmount"]

log = logging.getLogger("cachefs.fuse")


def serve_mount(config: Config, url: str, mountpoint: str, *, workers: int = 4, passthrough: bool = True,
                ready=None) -> FuseSession:
    """Mount ``url`` at ``mountpoint`` and serve it until unmounted. ``ready(session)`` is called once the
    kernel's INIT is answered (the mount is usable and ``session.mode`` known).
    A stale mount left by a dead daemon is cleaned up first."""
    engine = get_engine(config)
    ds = run_sync(engine.open_dataset(url))
    if is_stale_mount(mountpoint):
        log.warning("%s: cleaning up a stale mount (its daemon is gone)", mountpoint)
        unmount(mountpoint)
    fd = open_fuse_device()
    session = FuseSession(CacheFS(engine, ds), fd, workers=workers, passthrough=passthrough)
    cache_dir = config.cache.dir
    try:
        mount_fuse(fd, mountpoint)

        def on_init(s: FuseSession) -> None:
            record_mount(cache_dir, mountpoint, ds.ref.url, s.mode, s.fs.stats)
            threading.Thread(target=publish_stats, args=(s,), name="cachefs-fuse-stats", daemon=True).start()
            if ready is not None:
                ready(s)

        def publish_stats(s: FuseSession) -> None:  # what `cachefs status` shows about this mount, every second
            last = dict(s.fs.stats)
            while not s.stopped.wait(1.0):
                now = dict(s.fs.stats)
                if now != last:
                    record_mount(cache_dir, mountpoint, ds.ref.url, s.mode, now)
                    last = now

        session.on_init = on_init
        session.serve()
    finally:
        forget_mount(cache_dir, mountpoint)
        os.close(fd)
    return session

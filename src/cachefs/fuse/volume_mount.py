"""The daemon of a writable checkpoint mount (``cachefs mount URL MOUNTPOINT --writable``): the volume, its
upload, and the FUSE session over it, started by the mount's holder like the dataset daemon is."""

from __future__ import annotations

import logging
import os

from cachefs.base.aio import run_sync
from cachefs.base.collector import quiet_collector
from cachefs.base.config import Config
from cachefs.engine import get_engine
from cachefs.fuse.handover import announce_failure, announce_ready, receive_fd
from cachefs.fuse.writable import WritableSession
from cachefs.index.mounts import forget_mount, record_mount
from cachefs.write.opening import open_volume

__all__ = ["serve_writable_mount", "volume_session"]

log = logging.getLogger("cachefs.fuse")


def volume_session(mountpoint: str) -> str:
    """The volume a writable mount point writes into: the same one again after a restart or a remount there."""
    return "mount:" + os.path.abspath(mountpoint)


def serve_writable_mount(config: Config, url: str, mountpoint: str, *, attach: str, workers: int = 4,
                         group: int | None = None, shared: bool = False, ready=None) -> WritableSession:
    """Serve the writable volume of ``url`` on the mount whose descriptor the holder at ``attach`` owns, until
    unmounted. A daemon started again after one died resumes the volume's queue from its journal. Who may
    create files at the top: members of ``group`` (setgid, 2775); with ``shared`` and no group, every user the
    mount lets in (1777, as /tmp); else the mounting user (0755)."""
    fd, info = receive_fd(attach)
    engine = get_engine(config)  # the memory budget, and the read cache's eviction that makes room for staged bytes
    try:
        volume = open_volume(config, url, session=volume_session(mountpoint), services=engine.node_services,
                             mountpoint=os.path.abspath(mountpoint))
        run_sync(engine.start_background())  # (follows the cache group's members file: where copies go)
        run_sync(volume.start())
        if group is not None:
            os.chown(volume.tree, -1, group)
            os.chmod(volume.tree, 0o2775)
        else:
            os.chmod(volume.tree, 0o1777 if shared else 0o755)
    except (OSError, ValueError) as exc:
        announce_failure(attach, str(exc))
        os.close(fd)
        raise
    generation = int(info.get("generation", 0))
    cache_dir = config.cache.dir

    def on_init(s: WritableSession) -> None:
        record_mount(cache_dir, mountpoint, volume.url, s.mode, dict(s.stats))
        s.publish_every_second(lambda tick: record_mount(cache_dir, mountpoint, volume.url, s.mode, dict(s.stats)))
        if ready is not None:
            ready(s)

    session = WritableSession(volume, fd, workers=workers, generation=generation, on_init=on_init)
    quiet_collector()
    try:
        announce_ready(attach)
        session.serve(resume=generation > 0)
    finally:
        forget_mount(cache_dir, mountpoint)
        run_sync(volume.stop())
        os.close(fd)
    return session

"""Where a node's writable volumes live, and opening one: ``<cache>/volumes/<id>/``, one per volume URL and session
(a mount point, or a process), owned by the process holding its lock."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Any

from cachefs.base.config import Config
from cachefs.base.errors import ConfigError
from cachefs.base.files import atomic_write, try_lock
from cachefs.base.types import canonical_url
from cachefs.index.volumes import volumes_root
from cachefs.write.services import NodeServices
from cachefs.write.volume import WritableVolume

__all__ = ["lock_volume", "open_volume"]


def lock_volume(vdir: str) -> int | None:
    """Take the volume's owner lock (held for the process's life); None if another live process holds it."""
    return try_lock(os.path.join(vdir, "lock"))


def open_volume(config: Config, url: str, *, session: str, storage_options: dict | None = None,
                services: NodeServices = NodeServices.NONE, **info: Any) -> WritableVolume:
    """The volume of ``url`` for ``session`` (a mount point, or a process's own), locked for this process.
    ``info`` is recorded in ``volume.json`` (e.g. the mount point)."""
    url = canonical_url(url).rstrip("/")
    key = hashlib.blake2b(f"{url}\0{session}".encode(), digest_size=8).hexdigest()
    vdir = os.path.join(volumes_root(config.cache.dir), key)
    os.makedirs(vdir, mode=0o700, exist_ok=True)
    fd = lock_volume(vdir)
    if fd is None:
        raise ConfigError(f"{url} ({session}) is being written by another process on this node")
    atomic_write(os.path.join(vdir, "volume.json"), json.dumps({"url": url, "session": session, **info}))
    node = os.environ.get("NODE_NAME") or socket.gethostname()
    volume = WritableVolume(config, url, vdir, writer=f"{node}/{key}", storage_options=storage_options,
                            services=services)
    volume.lock_fd = fd
    return volume

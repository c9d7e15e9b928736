"""Publishing a job's read order (``cachefs.publish_order``, ``cachefs order``): the node's cache then fetches
what each reader opens next ahead of it (cachefs.prefetch.orders; docs/SEMANTICS.md, "Epochs")."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any

from cachefs.base.config import load_config
from cachefs.base.errors import ConfigError
from cachefs.base.types import DatasetRef
from cachefs.index.mounts import list_mounts
from cachefs.index.orders import write_order
from cachefs.prefetch.orders import relative_paths

__all__ = ["default_publisher", "publish_order"]


def default_publisher() -> str:
    """This process, on this host: one order per reading process (ranks of a job, two jobs) by default."""
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}"


def publish_order(dataset: str, paths: Iterable[str], *, epoch: int | None = None, cache_dir: str | None = None,
                  publisher: str | None = None, config: str | None = None, **options: Any) -> str:
    """Tell the node's cache the order in which this process will read ``dataset``'s files.

    ``dataset``: the dataset's URL (``s3://bucket/prefix``) or a cachefs mount point of it. ``paths``: the files
    in the order they will be read: relative to the dataset's root, or full URLs, or paths under the mount point.
    ``epoch``: shown in ``cachefs status``. ``publisher``: whose order it is (default: this process); a later
    order of the same publisher replaces its earlier one, orders of other publishers stay. ``cache_dir``,
    ``config`` and other ``cache_*``/``engine_*`` options: as for the ``cachefs::`` filesystem. Returns once
    the order is on the node (the file written), where every process reading the dataset picks it up within a
    second. Raises :class:`~cachefs.base.errors.ConfigError` for a dataset or path it cannot place."""
    cfg = load_config(config, overrides={**options, "cache_dir": cache_dir})
    roots = [dataset]
    if "://" in dataset:
        ref = DatasetRef.from_url(dataset)
    else:
        mountpoint = os.path.abspath(dataset)
        mounts = [m for m in list_mounts(cfg.cache.dir) if os.path.abspath(m.get("mountpoint", "")) == mountpoint]
        if not mounts or not mounts[0].get("url"):
            raise ConfigError(f"{dataset}: not a dataset URL, nor a cachefs mount of the cache at {cfg.cache.dir} "
                              "(give the dataset's URL, or cache_dir= of the mount)")
        ref = DatasetRef.from_url(mounts[0]["url"])
        roots = [mountpoint, dataset]
    rel = relative_paths(paths, [ref.url, *roots])
    return write_order(cfg.cache.dir, ref.id, ref.url, rel, epoch=epoch, publisher=publisher or default_publisher())

"""Publishing a job's read order (``cachefs.publish_order``, ``cachefs order``): the node's cache then fetches
what each reader opens next ahead of it (cachefs.prefetch.orders; docs/SEMANTICS.md, "Epochs")."""

from __future__ import annotations

import errno
import json
import os
import socket
import tempfile
from collections.abc import Iterable
from typing import Any

from cachefs.base.config import load_config
from cachefs.base.errors import ConfigError
from cachefs.base.types import DatasetRef
from cachefs.index.orders import check_publisher, write_order
from cachefs.prefetch.orders import published_here, relative_paths

__all__ = ["default_publisher", "publish_order"]


def default_publisher() -> str:
    """This process, on this host: one order per reading process (ranks of a job, two jobs) by default."""
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}"


def publish_order(dataset: str, paths: Iterable[str], *, epoch: int | None = None, cache_dir: str | None = None,
                  publisher: str | None = None, config: str | None = None, **options: Any) -> str:
    """Tell the node's cache the order in which this process will read ``dataset``'s files.

    ``dataset``: the dataset's URL (``s3://bucket/prefix``), or a cachefs mount point of it (the order then goes
    through the mount to its daemon: a pod reading through a CSI volume can publish). ``paths``: the files in the
    order they will be read: relative to the dataset's root, or full URLs, or paths under the mount point.
    ``epoch``: shown in ``cachefs status``. ``publisher``: whose order it is (default: this process); a later
    order of the same publisher replaces its earlier one, orders of other publishers stay. ``cache_dir``,
    ``config`` and other ``cache_*``/``engine_*`` options: as for the ``cachefs::`` filesystem. Returns once
    the order is on the node, where every process reading the dataset picks it up within a second: the file
    written, or the mount's answer. Raises :class:`~cachefs.base.errors.ConfigError` for a dataset or path it
    cannot place."""
    publisher = check_publisher(publisher or default_publisher())
    if "://" not in dataset:
        return _publish_through_mount(dataset, list(paths), epoch, publisher)
    cfg = load_config(config, overrides={**options, "cache_dir": cache_dir})
    ref = DatasetRef.from_url(dataset)
    rel = relative_paths(paths, [ref.url])
    written = write_order(cfg.cache.dir, ref.id, ref.url, rel, epoch=epoch, publisher=publisher)
    published_here(cfg.cache.dir, ref.id)
    return written


def _publish_through_mount(mountpoint: str, paths: list[str], epoch: int | None, publisher: str) -> str:
    """Hand the order to the mount's daemon (cachefs.fuse.order_channel): the way in for a process that sees
    the mount but not the node's cache directory (a pod on a CSI volume)."""
    root = os.path.abspath(mountpoint)
    if not os.path.isdir(root):
        raise ConfigError(f"{mountpoint}: not a dataset URL, nor a directory")
    prefix = root.rstrip("/") + "/"
    rel = [p[len(prefix):] if isinstance(p, str) and p.startswith(prefix) else p for p in paths]
    fd, tmp = tempfile.mkstemp(prefix="cachefs-order-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"paths": rel, "epoch": epoch, "publisher": publisher}, f)
        try:
            answer = os.getxattr(root, "user.cachefs.publish:" + tmp)
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.ENODATA, errno.ENOSYS):
                raise ConfigError(f"{mountpoint}: not a cachefs mount (or one too old to take orders)") from None
            raise ConfigError(f"{mountpoint}: the mount refused the order: {os.strerror(exc.errno or 0)} "
                              "(paths must be files of its dataset; see its log)") from None
    finally:
        os.unlink(tmp)
    return answer.decode(errors="replace")

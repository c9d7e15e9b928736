"""Declared read orders on disk: what a job says it will read, one file per publisher, shared by every process
of the node (written by ``cachefs.publish_order``; read by :class:`cachefs.prefetch.orders.OrderBook` and
``cachefs status``).

Layout (docs/FORMAT.md): ``<cache dir>/orders/<dataset id>/<publisher>.json``, written atomically: ``{"version":
1, "dataset": URL, "epoch": N or null, "published_at": epoch seconds, "paths": [relative path, ...]}``. An order
nobody republished for :data:`ORDER_TTL` seconds is ignored.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass

from cachefs.base.errors import ConfigError
from cachefs.base.files import atomic_write

__all__ = ["MAX_PATHS", "ORDER_TTL", "OrderFile", "check_publisher", "list_orders", "orders_dir", "read_order",
           "write_order"]

#: An order nobody republished for this long is ignored (a job that ended; each epoch republishes).
ORDER_TTL = 6 * 3600.0
#: The most paths one order may hold.
MAX_PATHS = 50_000_000
_PUBLISHER = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True)
class OrderFile:
    """One publisher's order file as listed: its path and (mtime, size), which change with every publish."""

    publisher: str
    path: str
    stamp: tuple[float, int]


def check_publisher(publisher: str) -> str:
    """``publisher`` if it is a usable name, else ConfigError."""
    if not isinstance(publisher, str) or not _PUBLISHER.match(publisher):
        raise ConfigError(f"publisher name {publisher!r}: use 1-128 letters, digits, '_', '.', '-'")
    return publisher


def orders_dir(cache_dir: str, ds_id: str | None = None) -> str:
    d = os.path.join(cache_dir, "orders")
    return d if ds_id is None else os.path.join(d, ds_id)


def write_order(cache_dir: str, ds_id: str, url: str, paths: list[str], *, epoch: int | None,
                publisher: str) -> str:
    """Publish ``paths`` (relative to the dataset's root, in the order they will be read) as ``publisher``'s
    order; the file written. Replaces that publisher's earlier order."""
    check_publisher(publisher)
    if len(paths) > MAX_PATHS:
        raise ConfigError(f"an order holds at most {MAX_PATHS} paths (got {len(paths)})")
    for p in paths:
        if not isinstance(p, str) or not p or p.startswith("/") or "\0" in p or ".." in p.split("/"):
            raise ConfigError(f"order path {p!r}: give paths relative to the dataset's root")
    doc = {"version": 1, "dataset": url, "epoch": epoch, "published_at": time.time(), "paths": paths}
    path = os.path.join(orders_dir(cache_dir, ds_id), f"{publisher}.json")
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)  # (a cache directory made here is made as the engine makes it)
    atomic_write(path, json.dumps(doc, separators=(",", ":")), dir_mode=0o700)  # (the cache directory's own mode)
    return path


def list_orders(cache_dir: str, ds_id: str, now: float | None = None) -> list[OrderFile]:
    """The dataset's orders in force (published within :data:`ORDER_TTL`)."""
    now = time.time() if now is None else now
    d = orders_dir(cache_dir, ds_id)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(d, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if now - st.st_mtime <= ORDER_TTL:
            out.append(OrderFile(name[:-5], path, (st.st_mtime, st.st_size)))
    return out


def read_order(path: str) -> tuple[int | None, list[str]] | None:
    """(epoch, paths) of an order file; None if it cannot be read as one."""
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
        paths = doc["paths"]
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            return None
        epoch = doc.get("epoch")
        return (int(epoch) if epoch is not None else None), paths
    except (OSError, ValueError, KeyError, TypeError):
        return None

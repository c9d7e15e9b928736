"""Which cache directory a command means when it was not told (no ``--cache-dir``, ``CACHEFS_CACHE_DIR`` or config
file): the one a mount point it names is served from, the one holding a volume or dataset at a URL it names, the
default when that holds a cache, else the only cache this user has on the node; otherwise it says which exist."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from cachefs.base.config import Config, default_cache_dir
from cachefs.base.errors import ConfigError
from cachefs.base.types import canonical_url, within
from cachefs.index.caches import is_cache, known_caches
from cachefs.index.mounts import list_mounts
from cachefs.index.volumes import volume_dirs

__all__ = ["cache_for", "caches_holding", "other_caches"]

#: The commands that look for their cache, and the argument naming what they are about.
TARGETS = {"sync": "target", "status": "target", "order": "dataset", "umount": "mountpoint", "evict": "url",
           "refresh": "url", "prefetch": "url", "mount": "url", "pack": "url", "pin": "url"}
#: Those that go on with the default cache when theirs is not found: the ones that fill a cache (a dataset no cache
#: holds yet goes to the default one), and umount (it needs a cache only to drain a writable mount's uploads).
LENIENT = {"umount", "prefetch", "mount", "pack"}


def told(args_cache_dir: str | None, config: Config) -> bool:
    """Whether the user said which cache (flag, environment or config file)."""
    return bool(args_cache_dir) or "CACHEFS_CACHE_DIR" in os.environ or config.cache.dir != default_cache_dir()


def cache_for(command: str, target: str | None, config: Config, *, explicit: bool) -> Config:
    """``config`` with the cache directory ``command`` (about ``target``) means; unchanged when it was told."""
    if explicit or command not in TARGETS:
        return config
    default = config.cache.dir
    caches = _unique([*known_caches(), *([default] if is_cache(default) else [])])
    if target:
        found = caches_holding(target, caches)
        if len(found) == 1:
            return _with_dir(config, found[0])
        if len(found) > 1:
            raise ConfigError(f"{target} is in {len(found)} caches on this node ({', '.join(found)}): say which with "
                              "--cache-dir")
    if is_cache(default) or not caches or command in LENIENT:
        return config
    if len(caches) == 1:
        return _with_dir(config, caches[0])
    raise ConfigError(f"no cache at {default}; this node has {len(caches)}: {', '.join(caches)} (say which with "
                      "--cache-dir)")


def other_caches(config: Config) -> list[str]:
    """This user's caches on the node besides ``config``'s."""
    here = os.path.realpath(config.cache.dir)
    return [c for c in known_caches() if os.path.realpath(c) != here]


def caches_holding(target: str, caches: Iterable[str]) -> list[str]:
    """The caches that serve the mount at (or above) the path ``target``, or hold a writable volume or a dataset at
    (or above) the URL ``target``."""
    if "://" in target:
        url = canonical_url(target).rstrip("/")
        return [c for c in caches if _holds_url(c, url)]
    path = os.path.abspath(target)
    return [c for c in caches if any(within(path, m.get("mountpoint", "")) for m in list_mounts(c))
            or any(within(path, info.get("mountpoint", "")) for _d, info in volume_dirs(c))]


def _holds_url(cache: str, url: str) -> bool:
    if any(within(url, info.get("url", "")) for _d, info in volume_dirs(cache)):
        return True
    from cachefs.index import Index

    try:
        return any(within(url, rec.url) for rec in Index(cache).datasets())
    except OSError:
        return False



def _with_dir(config: Config, path: str) -> Config:
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, dir=path))


def _unique(paths: list[str]) -> list[str]:
    seen: dict[str, str] = {}
    for p in paths:
        seen.setdefault(os.path.realpath(p), p)
    return sorted(seen.values())

"""Which mounts this cache directory serves, and in which mode: one small JSON file per mount under
``<cache dir>/mounts/``, written once mounted and removed at exit; ``cachefs status`` reads them."""

from __future__ import annotations

import hashlib
import json
import os

__all__ = ["forget_mount", "list_mounts", "mount_file", "record_mount"]


def _dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "mounts")


def mount_file(cache_dir: str, mountpoint: str, suffix: str) -> str:
    """``<cache dir>/mounts/<key of the mount point><suffix>``: where a mount's record (``.json``), journal
    (``.journal``) and hand-over socket (``.sock``) live."""
    key = hashlib.blake2b(os.path.abspath(mountpoint).encode(), digest_size=8).hexdigest()
    return os.path.join(_dir(cache_dir), key + suffix)


def mount_record_path(cache_dir: str, mountpoint: str) -> str:
    return mount_file(cache_dir, mountpoint, ".json")


def record_mount(cache_dir: str, mountpoint: str, url: str, mode: str, stats: dict | None = None, *,
                 opens_skipped: bool = False) -> None:
    """``mode``: passthrough or userspace; ``opens_skipped``: the kernel opens files without asking."""
    os.makedirs(_dir(cache_dir), exist_ok=True)
    tmp = mount_record_path(cache_dir, mountpoint) + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"mountpoint": os.path.abspath(mountpoint), "url": url, "pid": os.getpid(), "mode": mode,
                   "opens_skipped": opens_skipped, "stats": stats or {}}, f)
    os.replace(tmp, mount_record_path(cache_dir, mountpoint))


def forget_mount(cache_dir: str, mountpoint: str) -> None:
    try:
        os.unlink(mount_record_path(cache_dir, mountpoint))
    except FileNotFoundError:
        pass


def list_mounts(cache_dir: str) -> list[dict]:
    """Live mounts (records of daemons that are gone are dropped)."""
    out = []
    try:
        names = sorted(os.listdir(_dir(cache_dir)))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(_dir(cache_dir), name)) as f:
                rec = json.load(f)
            if not _alive(int(rec["pid"])):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append(rec)
    return out


def _alive(pid: int) -> bool:
    """A running process (a zombie, killed but not yet reaped, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False

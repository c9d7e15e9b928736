"""Which writable volumes this cache directory holds, and how their uploads are doing: ``<cache
dir>/volumes/<key>/`` with ``volume.json`` (the URL and who writes it) and ``status.json`` (staged bytes, the
upload's progress and failures), written by the process that owns the volume and read by ``cachefs status`` and
``cachefs sync``. The owner holds ``lock`` (flock) for its life; a volume whose lock is free has no live owner,
and its queue is resumed by the next one to open it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from typing import Any

__all__ = ["journal_last_seq", "list_volumes", "owner_alive", "read_status", "volume_dirs", "volumes_root", "wait_for_owner",
           "wait_uploaded"]


def volumes_root(cache_dir: str) -> str:
    return os.path.join(cache_dir, "volumes")


def volume_dirs(cache_dir: str) -> list[tuple[str, dict[str, Any]]]:
    """Every volume directory under the cache directory, with its ``volume.json``."""
    root = volumes_root(cache_dir)
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, name, "volume.json")) as f:
                out.append((os.path.join(root, name), json.load(f)))
        except (OSError, ValueError):
            continue
    return out


def owner_alive(vdir: str) -> bool:
    """Whether a live process holds the volume (its owner lock is taken)."""
    try:
        fd = os.open(os.path.join(vdir, "lock"), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def read_status(vdir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(vdir, "status.json")) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def journal_last_seq(vdir: str) -> int:
    """The highest entry number in the volume's journal: every close acknowledged so far is at or below it (the
    journal is fsynced before a close returns; status.json may lag it)."""
    last = 0
    try:
        with open(os.path.join(vdir, "journal")) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                last = max(last, int(r.get("seq", 0)), int(r.get("to", 0)))
    except FileNotFoundError:
        pass
    return last


def list_volumes(cache_dir: str) -> list[dict[str, Any]]:
    """What ``cachefs status`` shows per volume: its record, its last status, and whether its owner lives."""
    out = []
    for vdir, info in volume_dirs(cache_dir):
        st = read_status(vdir)
        out.append({**info, **st, "dir": vdir, "owner_alive": owner_alive(vdir)})
    return out


def wait_for_owner(vdir: str, target: int, deadline: float | None) -> tuple[bool, list[str]]:
    """Wait while the volume's live owner uploads every entry up to ``target``; (done, what is pending). Done
    too when the owner is gone (nothing more happens here: whoever opens the volume next resumes it)."""
    while True:
        st = read_status(vdir)
        if int(st.get("done_through", -1)) >= target and st.get("time", 0) > 0:
            return True, []
        if not owner_alive(vdir):
            return False, list(st.get("pending") or [f"entries up to {target}"])
        if deadline is not None and time.monotonic() > deadline:
            return False, list(st.get("pending") or [f"entries up to {target}"])
        time.sleep(0.1)


def wait_uploaded(cache_dir: str, mountpoint: str, timeout: float) -> tuple[bool, list[str]]:
    """Wait (up to ``timeout`` seconds) until the writable mount at ``mountpoint`` has uploaded every file closed
    so far; (done, what is pending). A mount point without a volume has nothing to wait for."""
    deadline = time.monotonic() + timeout
    for vdir, info in volume_dirs(cache_dir):
        if info.get("mountpoint") == os.path.abspath(mountpoint):
            return wait_for_owner(vdir, journal_last_seq(vdir), deadline)
    return True, []

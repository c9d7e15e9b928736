"""Which mounts this cache directory serves, and how they are doing: small JSON files under
``<cache dir>/mounts/``, read by ``cachefs status``.

Per mount there are two: the holder's (``<key>.holder.json``: mount point, dataset, state ``starting`` /
``serving`` / ``failing`` and why), written by the holder for the mount's whole life, and the serving daemon's
(``<key>.json``: mode and counters), written while a daemon serves. A record of a process that is gone is
ignored.

They live on the cache disk, which may be full: a record that cannot be written is skipped (the next write
tries again) and never stops the process writing it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import time

from cachefs.base.files import atomic_write
from cachefs.base.sockets import socket_path_for

__all__ = ["forget_holder", "forget_mount", "holder_socket", "holder_state", "left_behind", "list_mounts",
           "mount_file", "process_alive", "record_holder", "record_left_behind", "record_mount", "write_record"]

log = logging.getLogger("cachefs.fuse")
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "mounts")


def mount_file(cache_dir: str, mountpoint: str, suffix: str) -> str:
    """``<cache dir>/mounts/<key of the mount point><suffix>``: where a mount's records (``.json``,
    ``.holder.json``), journal (``.journal``) and hand-over socket (``.sock``) live."""
    key = hashlib.blake2b(os.path.abspath(mountpoint).encode(), digest_size=8).hexdigest()
    return os.path.join(_dir(cache_dir), key + suffix)


def holder_socket(cache_dir: str, mountpoint: str) -> str:
    """Where the mount's holder listens for its daemons (beside its records, or in the runtime directory when that
    path is too long for a unix socket)."""
    return socket_path_for(mount_file(cache_dir, mountpoint, ".sock"))


def mount_record_path(cache_dir: str, mountpoint: str) -> str:
    return mount_file(cache_dir, mountpoint, ".json")


def write_record(path: str, obj: dict) -> bool:
    """Replace ``path`` with ``obj`` as JSON (temp file, rename); False if the disk had no room (nothing changes):
    a record of the cache disk never stops the process writing it."""
    try:
        atomic_write(path, json.dumps(obj), dir_mode=0o700)
        return True
    except OSError as exc:
        if exc.errno not in _FULL:
            raise
        log.debug("record %s not written: %s", path, exc.strerror)
        return False


def record_mount(cache_dir: str, mountpoint: str, url: str, mode: str, stats: dict | None = None, *,
                 opens_skipped: bool = False, mirror_problem: str | None = None) -> bool:
    """The serving daemon's record. ``mode``: passthrough or userspace; ``opens_skipped``: the kernel opens
    files without asking; ``mirror_problem``: why the dataset's packed mirror cannot be used. False if the disk
    had no room for it."""
    return write_record(mount_record_path(cache_dir, mountpoint), {
        "mountpoint": os.path.abspath(mountpoint), "url": url, "pid": os.getpid(), "mode": mode,
        "opens_skipped": opens_skipped, "stats": stats or {}, "mirror_problem": mirror_problem})


def forget_mount(cache_dir: str, mountpoint: str) -> None:
    try:
        os.unlink(mount_record_path(cache_dir, mountpoint))
    except FileNotFoundError:
        pass


def record_holder(cache_dir: str, mountpoint: str, url: str, state: str, reason: str = "") -> bool:
    """The holder's record: ``state`` is starting, serving or failing (``reason`` says why)."""
    return write_record(mount_file(cache_dir, mountpoint, ".holder.json"), {
        "mountpoint": os.path.abspath(mountpoint), "url": url, "holder_pid": os.getpid(), "state": state,
        "reason": reason, "since": time.time()})


def forget_holder(cache_dir: str, mountpoint: str) -> None:
    for suffix in (".holder.json", ".pin.json"):
        try:
            os.unlink(mount_file(cache_dir, mountpoint, suffix))
        except FileNotFoundError:
            pass


def record_pin(cache_dir: str, mountpoint: str, url: str, version: int, holder_pid: int) -> bool:
    """The manifest version a mount serves, for as long as its holder lives: ``cachefs refresh`` keeps it (a
    restarted daemon must find it). False if the disk had no room for the record."""
    return write_record(mount_file(cache_dir, mountpoint, ".pin.json"),
                       {"mountpoint": os.path.abspath(mountpoint), "url": url, "version": version,
                        "holder_pid": holder_pid})


def pinned_versions(cache_dir: str, url: str) -> set[int]:
    """Manifest versions of ``url`` that live mounts serve."""
    try:
        names = os.listdir(_dir(cache_dir))
    except (FileNotFoundError, NotADirectoryError):
        return set()
    out = set()
    for name in names:
        if name.endswith(".pin.json"):
            rec = _read(os.path.join(_dir(cache_dir), name))
            if rec is not None and rec.get("url") == url and process_alive(rec.get("holder_pid")) \
                    and isinstance(rec.get("version"), int):
                out.add(rec["version"])
    return out


def holder_state(cache_dir: str, mountpoint: str) -> dict | None:
    """The holder record of a live holder of ``mountpoint``, or None."""
    rec = _read(mount_file(cache_dir, mountpoint, ".holder.json"))
    return rec if rec is not None and process_alive(rec.get("holder_pid")) else None


def list_mounts(cache_dir: str) -> list[dict]:
    """Live mounts: each with ``state`` (and ``reason`` when failing) from its holder, and the serving
    daemon's ``pid``, ``mode`` and ``stats`` while one serves (``pid`` None, ``state`` restarting between
    daemons)."""
    try:
        names = sorted(os.listdir(_dir(cache_dir)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: dict[str, dict] = {}
    for name in names:
        if name.endswith(".holder.json"):
            rec = _read(os.path.join(_dir(cache_dir), name))
            if rec is not None and process_alive(rec.get("holder_pid")):
                out.setdefault(rec["mountpoint"], {}).update(
                    {k: rec[k] for k in ("mountpoint", "url", "holder_pid", "state", "reason") if k in rec})
    for name in names:
        if name.endswith(".json") and not name.endswith((".holder.json", ".pin.json")):
            rec = _read(os.path.join(_dir(cache_dir), name))
            if rec is not None and process_alive(rec.get("pid")):
                m = out.setdefault(rec["mountpoint"], {"state": "serving"})
                holder = {k: m[k] for k in ("state", "reason", "holder_pid") if k in m}
                m.update(rec)
                m.update(holder)
    for m in out.values():
        if "pid" not in m:
            m.update(pid=None, mode="", stats={}, opens_skipped=False)
            if m.get("state") == "serving":
                m["state"] = "restarting"
    return [out[k] for k in sorted(out)]


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("mountpoint"), str) else None


def process_alive(pid) -> bool:
    """A running process (a zombie, killed but not yet reaped, does not count)."""
    if not isinstance(pid, int):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def record_left_behind(cache_dir: str, left: dict[str, str]) -> None:
    """Note the sessions a node pod generation could not take over from an earlier one (``{mountpoint: why}``;
    that generation keeps serving them), or clear the note when ``left`` is empty."""
    path = os.path.join(_dir(cache_dir), "handover-left.json")
    if not left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    write_record(path, {"since": time.time(), "sessions": left})


def left_behind(cache_dir: str) -> dict[str, str]:
    """What :func:`record_left_behind` noted, ``{}`` when nothing."""
    try:
        with open(os.path.join(_dir(cache_dir), "handover-left.json")) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return {}
    sessions = rec.get("sessions") if isinstance(rec, dict) else None
    return {str(k): str(v) for k, v in sessions.items()} if isinstance(sessions, dict) else {}

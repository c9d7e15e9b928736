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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENTRY_KINDS", "JournalState", "journal_last_seq", "list_volumes", "owner_alive", "queue_figures",
           "read_status", "replay_journal", "volume_dirs", "volumes_root", "wait_for_owner", "wait_uploaded"]

#: The journal's entry records (``t``): upload a closed file's snapshot, copy or delete an object, claim a
#: checkpoint's name, write its commit record (cachefs.write.queue.EntryKind).
ENTRY_KINDS = frozenset({"put", "copy", "delete", "claim", "commit"})


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


@dataclass
class JournalState:
    """A volume's queue as its journal has it: the live entries in order (each a dict: ``t``, ``seq``, ``key``,
    ``size``, ``src``, ``snap``, ``added``, ``begun``, ``held_by``), entries failed for good, the next number."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    next_seq: int = 1


def replay_journal(path: str) -> JournalState:
    """Read a volume's journal (cachefs.write.queue keeps it); a line cut by a crash mid-write is skipped (it was
    never acknowledged). Reads only."""
    state = JournalState()
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return state
    by_seq: dict[int, dict[str, Any]] = {}
    entries = state.entries
    for line in lines:
        try:
            r = json.loads(line)
            t, seq = r.get("t"), int(r.get("seq", 0))
        except (ValueError, AttributeError, TypeError):
            continue
        state.next_seq = max(state.next_seq, seq + 1)
        if t in ENTRY_KINDS:
            e = {"t": t, "seq": seq, "key": r["key"], "size": int(r.get("size", 0)), "src": r.get("src", ""),
                 "snap": int(r.get("snap", 0)), "added": float(r.get("added", 0)), "begun": [], "held_by": []}
            by_seq[seq] = e
            before = r.get("before")
            at = next((i for i, x in enumerate(entries) if x["seq"] == before), None) if before else None
            entries.insert(len(entries) if at is None else at, e)
        elif t == "move" and seq in by_seq:
            e = by_seq.pop(seq)
            entries.remove(e)
            e["seq"], e["key"] = int(r["to"]), r["key"]
            by_seq[e["seq"]] = e
            entries.append(e)
            state.next_seq = max(state.next_seq, e["seq"] + 1)
        elif t == "held" and seq in by_seq:
            by_seq[seq]["held_by"] = [str(m) for m in r.get("by", [])]
        elif t == "mpu-begin" and seq in by_seq and r["key"] not in by_seq[seq]["begun"]:
            by_seq[seq]["begun"].append(str(r["key"]))
        elif t in ("done", "drop", "failed"):
            gone = by_seq.pop(seq, None)
            if gone is not None:
                entries.remove(gone)
            if t == "failed":
                state.failed[seq] = r.get("error", "")
    return state


def queue_figures(entries: Sequence[tuple[str, str, int, float]], dirty: int = 0) -> dict[str, Any]:
    """What status shows of a volume's queue: ``entries`` as (kind, key, size, when added), in queue order;
    ``dirty``: bytes written to open files, not queued yet."""
    puts = [e for e in entries if e[0] == "put"]
    return {"staged_bytes": sum(e[2] for e in puts) + dirty, "staged_files": len(puts),
            "queued_entries": len(entries),
            "oldest_staged_age": (time.time() - min(e[3] for e in entries)) if entries else 0.0,
            "pending": [f"{kind} {key}" for kind, key, _size, _added in entries[:20]]}


def list_volumes(cache_dir: str) -> list[dict[str, Any]]:
    """What ``cachefs status`` shows per volume: its record, its last status, and whether its owner lives. A volume
    without a live owner is shown as its journal has it (what its owner last wrote may be older): what is queued
    and not uploaded yet, and ``done`` when nothing is."""
    out = []
    for vdir, info in volume_dirs(cache_dir):
        st = read_status(vdir)
        alive = owner_alive(vdir)
        if not alive:
            journal = replay_journal(os.path.join(vdir, "journal"))
            st = {**st, **queue_figures([(e["t"], e["key"], e["size"], e["added"]) for e in journal.entries]),
                  "below_promise_bytes": 0, "failed": {str(k): v for k, v in journal.failed.items()}}
        out.append({**info, **st, "dir": vdir, "owner_alive": alive,
                    "done": not alive and not st.get("queued_entries")})
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

"""What a restarted FUSE daemon must know about the kernel's view of the mount, kept in an append-only
journal beside the mount record.

The kernel keeps a mount's state across a daemon restart (the ``/dev/fuse`` descriptor lives on in the
holder): the INIT it negotiated, the inode numbers it holds, the file handles of open files and the
passthrough backing ids it registered. A new daemon cannot ask the kernel for any of that, so the daemon
writes it down as it hands it out: one JSON line per fact, written with one unbuffered ``write`` (it survives
SIGKILL; only a machine crash loses it, and that loses the mount too).

Only what cannot be rebuilt is written, and nothing per open: backing ids when registered or dropped. The
inodes the kernel holds are in the mount's inode table (:mod:`.inode_table`); a journal written by a release that
kept them here (``i`` and ``f`` records, hand-over version 1) is still read, and its inodes are moved to the table
(:meth:`MountJournal.inodes_moved`). File and directory handles are rebuilt on first use from the request itself
(it carries the inode).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from dataclasses import dataclass, field

from cachefs.base.fallocate import allocate_ahead
from cachefs.base.files import atomic_write

__all__ = ["JournalState", "MountJournal"]

log = logging.getLogger("cachefs.fuse")

#: Rewrite the journal with just the live state once it grows past this.
COMPACT_BYTES = 32 << 20
#: Appends go into space allocated ahead in steps of this much, so that a cache disk that fills up later does
#: not stop the journal at once.
PREALLOCATE = 128 << 10
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class JournalState:
    """The kernel-visible state a journal replays to."""

    init: dict | None = None  # {"mode": "passthrough"|"userspace", "flags": int, "manifest_version": int}
    generation: int = 0  # how many daemons served this mount before
    #: ino → path and ino → the version the kernel was shown, as a journal of a release before the inode table
    #: wrote them (empty otherwise): for the table to take.
    inodes: dict[int, str] = field(default_factory=dict)
    versions: dict[int, str] = field(default_factory=dict)
    backing: dict[int, int] = field(default_factory=dict)  # ino → backing id registered with the kernel
    opens_skipped: bool = False  # OPEN was answered ENOSYS: the kernel sends no more OPEN or RELEASE


class MountJournal:
    """Append-only journal at ``path``. :meth:`start` truncates it (a new mount); :meth:`resume` replays it
    (a restarted daemon) and continues it, compacted."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._lock = threading.Lock()
        self._size = self._live_size = 0
        self._allocated = 0
        #: The disk had no room for a record: the journal is kept in memory only from then on (a daemon
        #: restarted later may not know every inode the kernel holds; requests naming one get ESTALE).
        self.degraded = False
        self.state = JournalState()

    @classmethod
    def start(cls, path: str) -> MountJournal:
        j = cls(path)
        j._rewrite()
        return j

    @classmethod
    def resume(cls, path: str) -> MountJournal:
        j = cls(path)
        j.state = replay(path)
        j.state.generation += 1
        j._rewrite()
        return j

    # -- records --------------------------------------------------------------------------------------------
    def init(self, mode: str, flags: int, manifest_version: int) -> None:
        self.state.init = {"mode": mode, "flags": flags, "manifest_version": manifest_version}
        self._append(_line(["init", self.state.init]))

    def serves(self, manifest_version: int) -> None:
        """The mount serves ``manifest_version`` from now on (its first manifest was taken while it served): a
        restarted daemon opens that one."""
        init = self.state.init
        if init is not None and init["manifest_version"] != manifest_version:
            self.init(init["mode"], init["flags"], manifest_version)

    def skip_opens(self) -> None:
        self.state.opens_skipped = True
        self._append(_line(["noopen"]))

    def inodes_moved(self) -> None:
        """The inodes an earlier release journalled are in the inode table now: drop them here."""
        if self.state.inodes:
            self.state.inodes.clear()
            self.state.versions.clear()
            self._rewrite()

    def backing(self, ino: int, backing_id: int) -> None:
        self.state.backing[ino] = backing_id
        self._append(_line(["b", ino, backing_id]))

    def backing_closed(self, ino: int) -> None:
        self.state.backing.pop(ino, None)
        self._append(_line(["c", ino]))

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- file -----------------------------------------------------------------------------------------------
    def _write(self, data: bytes) -> bool:
        """Append ``data``; False (and the journal degraded) if the disk has no room for it."""
        if self.degraded or self._fd < 0:
            return False
        # Space allocated ahead (the size unchanged), so appends rarely need new blocks; with no room ahead,
        # appends go on while the disk takes them.
        if self._size + len(data) > self._allocated and allocate_ahead(self._fd, self._size, len(data) + PREALLOCATE):
            self._allocated = self._size + len(data) + PREALLOCATE
        try:
            os.write(self._fd, data)
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            self._degrade(exc)
            return False
        return True

    def _degrade(self, exc: OSError) -> None:
        if not self.degraded:
            self.degraded = True
            log.error("mount journal %s: %s; keeping it in memory only (a restarted daemon may not know every "
                      "inode)", self.path, exc.strerror)

    def _append(self, line: bytes) -> None:
        with self._lock:
            if not self._write(line):
                return
            self._size += len(line)
            # Compact once the file is twice what the last compaction left (at least COMPACT_BYTES): with many
            # backing files registered the live state alone is large, and a fixed limit would rewrite it all on
            # every append.
            if self._size > max(COMPACT_BYTES, 2 * self._live_size):
                self._rewrite_locked()

    def _rewrite(self) -> None:
        with self._lock:
            self._rewrite_locked()

    def _rewrite_locked(self) -> None:
        """Replace the file with the current state (write a temporary file, rename it over)."""
        s = self.state
        lines = [["gen", s.generation]]
        if s.init:
            lines.append(["init", s.init])
        if s.opens_skipped:
            lines.append(["noopen"])
        lines += [["i", ino, p, s.versions[ino]] if ino in s.versions else ["i", ino, p] for ino, p in s.inodes.items()]
        lines += [["b", ino, b] for ino, b in s.backing.items()]
        data = b"".join(_line(rec) for rec in lines)
        try:
            atomic_write(self.path, data, dir_mode=0o700)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            self._degrade(exc)
            return
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._size = self._live_size = self._allocated = len(data)
        self.degraded = False


def _line(rec: list) -> bytes:
    return (json.dumps(rec, separators=(",", ":")) + "\n").encode()


def replay(path: str) -> JournalState:
    """The state a journal describes. A torn last line (the writer died mid-write) is ignored."""
    s = JournalState()
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return s
    for line in raw.split(b"\n"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, list) or not rec:
            continue
        kind = rec[0]
        if kind == "gen":
            s.generation = int(rec[1])
        elif kind == "init":
            s.init = dict(rec[1])
        elif kind == "noopen":
            s.opens_skipped = True
        elif kind == "i":
            s.inodes[int(rec[1])] = rec[2]
            if len(rec) > 3:
                s.versions[int(rec[1])] = rec[3]
            else:
                s.versions.pop(int(rec[1]), None)
        elif kind == "f":
            s.inodes.pop(int(rec[1]), None)
            s.versions.pop(int(rec[1]), None)
        elif kind == "b":
            s.backing[int(rec[1])] = int(rec[2])
        elif kind == "c":
            s.backing.pop(int(rec[1]), None)
    return s

"""A volume's upload queue: what must reach the origin, in order, kept in an append-only journal.

Every change is one JSON line, fsynced before the call returns, so that what a writer was told is durable
survives ``kill -9`` and a reboot: the queue is rebuilt by replaying the journal. Entries run in list order
(:mod:`.uploader`); a new entry goes to the end, or ``before`` another when a rename or a commit must take
effect ahead of uploads already queued (see :meth:`UploadQueue.add`).
"""

from __future__ import annotations

import enum
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cachefs.index.volumes import replay_journal

__all__ = ["EntryKind", "QueueEntry", "UploadQueue", "fsync_dir", "under"]


class EntryKind(enum.StrEnum):
    """What an entry does on the origin (its value is what the journal records)."""

    #: Upload a closed file's snapshot.
    PUT = "put"
    #: Copy an object (a rename of what is there already), then...
    COPY = "copy"
    #: ...delete an object.
    DELETE = "delete"
    #: Claim a checkpoint directory's name before its objects go up.
    CLAIM = "claim"
    #: Write a checkpoint directory's commit record after all of them.
    COMMIT = "commit"

    @property
    def makes_object(self) -> bool:
        """It leaves an object under its key (a put or a copy)."""
        return self in (EntryKind.PUT, EntryKind.COPY)




@dataclass(eq=False)  # (an entry is itself: two are never "equal", list.remove/index find this one)
class QueueEntry:
    seq: int
    kind: EntryKind
    key: str  # the object (put, delete, copy's destination), or the checkpoint's name (claim, commit)
    size: int = 0
    src: str = ""  # copy: the source key
    snap: int = 0  # put: the snapshot of the closed file (``queue/<snap>`` in the volume)
    added: float = field(default_factory=time.time)
    running: bool = False
    #: Keys a multipart upload of it was asked to begin under: after a restart, every unfinished upload of those
    #: keys is aborted (found by listing: a process killed before the upload id came back never knew it).
    begun: list[str] = field(default_factory=list)
    error: str = ""  # the last failure, while it is retried
    etag: str = ""  # put: the object's ETag once it is on the origin
    held_by: list[str] = field(default_factory=list)  # put: members holding a copy until the upload

    def record(self) -> dict:
        out = {"t": self.kind, "seq": self.seq, "key": self.key, "added": self.added}
        if self.size:
            out["size"] = self.size
        if self.src:
            out["src"] = self.src
        if self.snap:
            out["snap"] = self.snap
        return out


class UploadQueue:
    """The ordered entries of one volume and their journal. Thread-safe: front doors add from their threads, the
    uploader takes and finishes entries from the event loop."""

    def __init__(self, path: str, lock: threading.RLock | None = None) -> None:
        """``lock``: the owner's, when the owner changes other state together with the queue (a volume's tree)."""
        self.path = path
        self.lock = lock if lock is not None else threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.entries: list[QueueEntry] = []
        self.next_seq = 1
        self.failed: dict[int, str] = {}  # entries given up for good (a lost commit race), by seq
        self.done_seqs: set[int] = set()
        self.uploaded_bytes = 0
        self._file = None
        self.on_change: Callable[[], None] | None = None  # the uploader's wake-up (thread-safe)
        self._replay()
        self._file = open(path, "a", buffering=1)

    # -- journal ------------------------------------------------------------------------------------------------
    def _replay(self) -> None:
        state = replay_journal(self.path)
        self.next_seq, self.failed = state.next_seq, state.failed
        for r in state.entries:
            e = QueueEntry(r["seq"], EntryKind(r["t"]), r["key"], r["size"], r["src"], r["snap"], r["added"])
            e.begun, e.held_by = r["begun"], r["held_by"]
            self.entries.append(e)
        self._compact()

    def _compact(self) -> None:
        """Rewrite the journal with only the live entries (atomically): it never grows past the queue."""
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for e in self.entries:
                f.write(json.dumps(e.record()) + "\n")
                for key in e.begun:
                    f.write(json.dumps({"t": "mpu-begin", "seq": e.seq, "key": key}) + "\n")
                if e.held_by:
                    f.write(json.dumps({"t": "held", "seq": e.seq, "by": e.held_by}) + "\n")
            for seq, err in self.failed.items():
                f.write(json.dumps({"t": "failed", "seq": seq, "error": err}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(os.path.dirname(self.path))

    def _append(self, record: dict, *, sync: bool = True) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        if sync:
            self._file.flush()
            os.fsync(self._file.fileno())

    # -- changes from the front doors ---------------------------------------------------------------------------
    def add(self, kind: EntryKind, key: str, *, size: int = 0, src: str = "", snap: int = 0,
            before: QueueEntry | None = None) -> QueueEntry:
        """Queue an entry at the end, or just before ``before`` (which must not have started), durably."""
        with self.lock:
            e = QueueEntry(self.next_seq, EntryKind(kind), key, size, src, snap)
            self.next_seq += 1
            record = e.record()
            if before is not None and before in self.entries and not before.running:
                record["before"] = before.seq
                self.entries.insert(self.entries.index(before), e)
            else:
                self.entries.append(e)
            self._append(record)
            self.changed.notify_all()
        self._wake()
        return e

    def reserve_seq(self) -> int:
        """A number for a snapshot about to be queued (linked under it before its entry is added)."""
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            return seq

    def move(self, e: QueueEntry, key: str) -> None:
        """Send ``e`` (not started) to the end of the queue under ``key``: a rename before the upload uploads under
        the final name, after what was queued before the rename."""
        with self.lock:
            new = self.next_seq
            self.next_seq += 1
            self._append({"t": "move", "seq": e.seq, "to": new, "key": key})
            self.entries.remove(e)
            e.seq, e.key = new, key
            self.entries.append(e)
            self.changed.notify_all()
        self._wake()

    def drop(self, e: QueueEntry) -> None:
        with self.lock:
            self.entries.remove(e)
            self._append({"t": "drop", "seq": e.seq})
            self.changed.notify_all()

    def pending(self, match: Callable[[QueueEntry], bool] = lambda e: True) -> list[QueueEntry]:
        with self.lock:
            return [e for e in self.entries if match(e)]

    # -- the uploader's side ------------------------------------------------------------------------------------
    def head(self, n: int) -> list[QueueEntry]:
        with self.lock:
            return self.entries[:n]

    def start(self, e: QueueEntry) -> bool:
        """Mark ``e`` finishing if it is still first in the queue: from now on a rename or delete of its key follows
        it instead of changing it. False if a rename moved it meanwhile, or an entry was put before it (a
        checkpoint's claim): the uploader takes the queue's head again."""
        with self.lock:
            if not self.entries or self.entries[0] is not e:
                return False
            e.running = True
            return True

    def held(self, e: QueueEntry, members: list[str]) -> None:
        """Other members hold a copy of ``e``'s snapshot (dropped after its upload), durably."""
        with self.lock:
            e.held_by = list(members)
            self._append({"t": "held", "seq": e.seq, "by": e.held_by})

    def multipart_begins(self, e: QueueEntry, key: str) -> None:
        """A multipart upload of ``e`` under ``key`` is about to be asked for (a restart looks for it)."""
        with self.lock:
            if key not in e.begun:
                e.begun.append(key)
                self._append({"t": "mpu-begin", "seq": e.seq, "key": key}, sync=False)

    def finished(self, e: QueueEntry, *, failed: str = "") -> None:
        """``e`` is on the origin (or given up for good, with the reason): off the queue, durably."""
        with self.lock:
            self._append({"t": "failed", "seq": e.seq, "error": failed} if failed else {"t": "done", "seq": e.seq})
            if e in self.entries:
                self.entries.remove(e)
            if failed:
                self.failed[e.seq] = failed
            elif e.kind is EntryKind.PUT:
                self.uploaded_bytes += e.size
            self.done_seqs.add(e.seq)
            if not self.entries and not self.failed and self._file is not None:
                self._file.close()
                self._compact()
                self._file = open(self.path, "a", buffering=1)
            self.changed.notify_all()

    def wait_changed(self, timeout: float) -> None:
        """Wait (the lock held) until the queue changes, or ``timeout`` seconds."""
        self.changed.wait(timeout=timeout)

    def done_through(self, seq: int) -> bool:
        """Whether every entry up to ``seq`` has left the queue (done, dropped or failed)."""
        with self.lock:
            return all(e.seq > seq for e in self.entries)

    def _wake(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def under(key: str, prefix: str) -> bool:
    """Whether ``key`` is ``prefix`` or inside it (``/``-separated)."""
    return key == prefix or key.startswith(prefix + "/") or prefix == ""

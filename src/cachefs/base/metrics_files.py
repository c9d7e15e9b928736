"""The files of prometheus-client's multiprocess mode, kept right on a node with many processes and containers.

Two things the library leaves to us:

* **Names.** Each process writes ``counter_<id>.db`` and so on, ``<id>`` being its pid by default. The node's
  containers (the CSI plugin, its mounter, the agent) share one metrics directory but not one pid namespace, so
  two live processes could have the same pid and write into one file, counting their series twice or garbling
  them. Our id is the pid *and* the pid namespace (:func:`process_identity`).
* **Dead processes.** Every process that ever ran leaves its files (a counter must not go down when a process
  exits, so the library keeps them); a node that runs a FUSE daemon per mount, restarted and replaced for weeks,
  collects thousands. Each process holds a shared lock on ``live_<id>.lock`` while it runs, so whoever scrapes
  can tell the dead from the live in any namespace (a lock it can take exclusively belongs to no live process):
  :func:`compact_dead` adds a dead process's counters and histograms into one ``*_archive.db`` file per type and
  removes its files, under a directory lock that scrapes take too, so no scrape sees a value twice or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
from collections import defaultdict

__all__ = ["ARCHIVE", "compact_dead", "directory_lock", "hold_live_lock", "live_identity", "process_identity"]

#: The ``<id>`` of the files that hold what dead processes counted.
ARCHIVE = "archive"
_ADDITIVE = ("counter", "histogram")  # types whose values from many processes are summed


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]") or "0"
    except OSError:
        return "0"


_NAMESPACE = _pid_namespace()  # (a fork stays in it; the library asks for the id at every update)


def process_identity() -> str:
    """This process's id in file names: ``<pid>-<pid namespace inode>`` (unique on the host while it runs)."""
    return f"{os.getpid()}-{_NAMESPACE}"


_held: dict[str, int] = {}


def live_identity() -> str:
    """:func:`process_identity`, with this process's live lock held (taken anew in a forked child)."""
    identity = process_identity()
    if identity not in _held:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:
            hold_live_lock(directory, identity)
    return identity


def hold_live_lock(directory: str, identity: str) -> None:
    """Take (and keep until exit) a shared lock saying the process ``identity`` is alive."""
    if identity in _held:
        return
    fd = os.open(os.path.join(directory, f"live_{identity}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _held[identity] = fd


@contextlib.contextmanager
def directory_lock(directory: str):
    """Exclusive use of the directory's files for a compaction and the scrape after it."""
    fd = os.open(os.path.join(directory, "compact.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _identity_of(path: str) -> str:
    name = os.path.basename(path)[:-3]  # <type>_<id>.db or gauge_<mode>_<id>.db
    return name.rsplit("_", 1)[1]


def _alive(directory: str, identity: str) -> bool:
    path = os.path.join(directory, f"live_{identity}.lock")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False  # no lock at all: a process from before locks, long gone (or an id we never gave)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def compact_dead(directory: str) -> int:
    """Fold the files of dead processes into the archive files and remove them; returns how many processes.
    Call with :func:`directory_lock` held."""
    from prometheus_client.mmap_dict import MmapedDict

    by_identity: dict[str, list[str]] = defaultdict(list)
    for path in glob.glob(os.path.join(directory, "*.db")):
        identity = _identity_of(path)
        if identity != ARCHIVE:
            by_identity[identity].append(path)
    dead = [i for i in by_identity if not _alive(directory, i)]
    if not dead:
        return 0
    sums: dict[str, dict[str, float]] = {typ: defaultdict(float) for typ in _ADDITIVE}
    for identity in dead:
        for path in by_identity[identity]:
            typ = os.path.basename(path).split("_", 1)[0]
            if typ in sums:
                for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(path):
                    sums[typ][key] += value
    for typ, values in sums.items():
        if values:
            archive = MmapedDict(os.path.join(directory, f"{typ}_{ARCHIVE}.db"))
            try:
                for key, value in values.items():
                    archive.write_value(key, archive.read_value(key)[0] + value, 0.0)
            finally:
                archive.close()
    for identity in dead:  # only once their values are in the archive
        for path in by_identity[identity]:
            os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, f"live_{identity}.lock"))
    return len(dead)

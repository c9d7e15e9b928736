"""Processes grouped the way a container runtime groups a container's processes, so that a test can
"restart a container" as the runtime does: every process in it is killed at once, wherever it was reparented.

Each :class:`Container` is a cgroup v2 of its own (``cgroup.kill`` kills all its members, children that
double-forked or called setsid included). Without a writable cgroup v2 the process tree under the processes
added is killed instead (a weaker model: it misses processes reparented to init).
"""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid

__all__ = ["Container"]


def _cgroup2_root() -> str | None:
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, mnt, fstype, *_ = line.split()
            if fstype == "cgroup2" and os.access(mnt, os.W_OK):
                return mnt
    return None


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return out


class Container:
    def __init__(self, name: str) -> None:
        root = _cgroup2_root()
        self.path = os.path.join(root, f"cachefs-test-{name}-{uuid.uuid4().hex[:8]}") if root else None
        if self.path:
            os.mkdir(self.path)
        self.pids: list[int] = []

    def add(self, pid: int) -> None:
        """Put ``pid`` in this container (call it before the process starts children)."""
        self.pids.append(pid)
        if self.path:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def members(self) -> list[int]:
        if self.path:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(p) for p in f.read().split()]
        tree, todo = [], list(self.pids)
        while todo:
            pid = todo.pop()
            if os.path.exists(f"/proc/{pid}"):
                tree.append(pid)
                todo += _children(pid)
        return tree

    def kill(self, timeout: float = 20.0) -> None:
        """Kill every process in the container (SIGKILL) and wait until none is left."""
        if self.path:
            with open(os.path.join(self.path, "cgroup.kill"), "w") as f:
                f.write("1")
        else:
            for pid in self.members():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        while self.members():
            assert time.monotonic() < deadline, f"container still has processes {self.members()}"
            time.sleep(0.05)

    def remove(self) -> None:
        if self.path and os.path.isdir(self.path):
            if self.members():
                self.kill()
            # An empty cgroup.procs does not mean the kernel is done: killed tasks still being reaped keep the
            # cgroup populated, and rmdir says EBUSY until they are gone (a flake seen in make test).
            deadline = time.monotonic() + 10
            while True:
                try:
                    os.rmdir(self.path)
                    return
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                time.sleep(0.05)

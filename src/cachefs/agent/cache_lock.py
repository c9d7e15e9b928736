"""One agent per cache directory, handed from one node pod generation to the next.

Two agents on one cache directory would fight (two peer servers for one node's bytes, two label publishers), so an
agent holds ``<cache dir>/cluster/agent.lock`` (an exclusive ``flock``) while it runs. A second one is refused,
naming the first, unless it runs as a node pod generation (``$CACHEFS_NODE_GENERATION``, the pod's UID): the
DaemonSet's rolling update starts the next node pod while the current one serves, so the newcomer writes its
generation (and pid) into ``agent.successor`` and waits for the lock; the holder sees the claim, shuts down as on
SIGTERM, lets go of the lock and stands by. A standing-by agent takes the lock again only when it is free and no
live claimant waits for it (the newcomer's pod went away first): contending with the claimant, it could win the lock
back and the rolling update would wait for ever on a newcomer that never gets ready. (Pids are compared across
node pods: the node pod runs in the host's PID namespace, as LMDB's reader table needs anyway.)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import threading

from cachefs.base.aio import stop_on_signals
from cachefs.base.config import prepare_cache_dir
from cachefs.base.errors import ConfigError
from cachefs.base.files import atomic_write
from cachefs.index.mounts import process_alive

__all__ = ["GENERATION_ENV", "CacheDirLock"]

log = logging.getLogger(__name__)

#: The node pod generation this process belongs to (the DaemonSet sets it from the pod's UID).
GENERATION_ENV = "CACHEFS_NODE_GENERATION"
#: How often the holder looks for a successor's claim, and a standing-by agent for a free lock.
CLAIM_POLL = 1.0


class CacheDirLock:
    """The agent lock of ``cache_dir``; ``who`` is written into it for a refused second agent to name."""

    def __init__(self, cache_dir: str, who: str) -> None:
        self.cache_dir, self.who = cache_dir, who
        self.path = os.path.join(cache_dir, "cluster", "agent.lock")
        self.successor_path = os.path.join(cache_dir, "cluster", "agent.successor")
        self.generation = os.environ.get(GENERATION_ENV, "")
        self._fd = -1
        self._released = threading.Event()

    def _open(self) -> int:
        prepare_cache_dir(self.cache_dir)
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _held(self, fd: int) -> None:
        self._fd = fd
        self._released.clear()
        os.ftruncate(fd, 0)
        generation = f", node pod generation {self.generation}" if self.generation else ""
        os.pwrite(fd, f"{self.who}{generation}\n".encode(), 0)

    def try_take(self) -> bool:
        """Take the lock if it is free. Busy: False for a node pod generation (:meth:`wait` for it), otherwise
        ConfigError naming the agent that holds it."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if self.generation:
                log.warning("cache directory %s is served by the previous node pod's agent (%s): waiting for it to "
                            "hand over", self.cache_dir, other)
                return False
            raise ConfigError(f"cache directory {self.cache_dir} is already served by an agent ({other}); give each "
                              "agent a cache directory of its own (--cache-dir)") from None
        self._held(fd)
        return True

    def _claim(self) -> tuple[str, int]:
        """(generation, pid) of the pending claim, ("", 0) when none."""
        try:
            with open(self.successor_path) as f:
                generation, _, pid = f.read().strip().partition(" ")
        except FileNotFoundError:
            return "", 0
        return generation, int(pid) if pid.isdigit() else 0

    async def stand_by(self) -> bool:
        """Wait until the lock is free and no live claimant waits for it, then take it; False if signalled."""
        stop = stop_on_signals()
        while not stop.is_set():
            generation, pid = self._claim()
            if not generation or not process_alive(pid):
                fd = self._open()
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                else:
                    self._held(fd)
                    return True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), CLAIM_POLL)
        return False

    async def wait(self) -> bool:
        """Claim the lock (its holder hands it over) and wait for it; False if signalled meanwhile."""
        atomic_write(self.successor_path, f"{self.generation} {os.getpid()}")
        fd = self._open()
        loop = asyncio.get_running_loop()
        got: asyncio.Future[bool] = loop.create_future()

        def settle(exc: OSError | None) -> None:
            if not got.done():
                got.set_result(True) if exc is None else got.set_exception(exc)

        def block() -> None:  # (a thread: a blocked flock in the loop's thread would not see SIGTERM)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                loop.call_soon_threadsafe(settle, exc)
                return
            loop.call_soon_threadsafe(settle, None)

        threading.Thread(target=block, name="cachefs-agent-lock", daemon=True).start()
        stop = stop_on_signals()
        stopped: asyncio.Future[bool] = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([got, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not got.done():
            os.close(fd)  # (the thread's flock then fails or is let go with the process)
            return False
        got.result()
        self._held(fd)
        return True

    def watch_for_successor(self) -> threading.Event:
        """While the lock is held: once another generation claims it, set the returned event and stop this agent as
        SIGTERM would (its caller releases the lock and stands by)."""
        claimed = threading.Event()
        if not self.generation:
            return claimed
        with contextlib.suppress(FileNotFoundError):  # (a claim granted, or one whose claimant is gone)
            os.unlink(self.successor_path)

        def watch() -> None:
            while not self._released.wait(CLAIM_POLL):
                who, _pid = self._claim()
                if who and who != self.generation:
                    log.warning("node pod generation %s claims cache directory %s: handing it over", who,
                                self.cache_dir)
                    claimed.set()
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

        threading.Thread(target=watch, name="cachefs-agent-successor", daemon=True).start()
        return claimed

    def release(self) -> None:
        self._released.set()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

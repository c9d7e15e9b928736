"""Starting a mount's holder (``cachefs mount … --foreground``) as a process of its own, and what its exit means."""

from __future__ import annotations

import os
import subprocess
import time

from cachefs.base.early_start import start_detached
from cachefs.base.errors import (
    CacheFSError,
    CacheFullError,
    ConfigError,
    CredentialsError,
    ObjectNotFoundError,
    OriginUnavailableError,
)
from cachefs.fuse.mount import is_fuse_mount
from cachefs.index.mounts import holder_state

__all__ = ["check_empty", "start_holder"]


def check_empty(mountpoint: str) -> None:
    """ConfigError if ``mountpoint`` has entries: a mount over them would hide them until unmounted (fusermount
    refuses this too, without ``-o nonempty``)."""
    with os.scandir(mountpoint) as it:
        if next(it, None) is not None:
            raise ConfigError(f"mount point {mountpoint} is not empty (a mount would hide what is in it until "
                              "unmounted); choose an empty directory, or pass --nonempty")


#: Exit codes of ``cachefs`` (cli.main.EXIT_CODES) back to the error a holder's exit stands for.
_EXIT_ERRORS: dict[int, type[CacheFSError]] = {2: ConfigError, 3: CredentialsError, 4: OriginUnavailableError,
                                               5: CacheFullError, 6: ObjectNotFoundError}


def start_holder(argv: list[str], mountpoint: str, log_path: str, *, cache_dir: str | None = None,
                 env: dict[str, str] | None = None, timeout: float = 120.0,
                 started: subprocess.Popen | None = None) -> subprocess.Popen:
    """Run ``argv`` (a ``cachefs mount … --foreground`` command: a holder) in its own session, its output
    appended to ``log_path``, and return it once ``mountpoint`` is mounted and served (with ``cache_dir``,
    the holder's record says so; without, once it is mounted). The caller owns the child (and reaps it). If
    it exits first, the error its exit code stands for, with the log's last line; CacheFSError on a timeout.
    ``started``: that holder, started already (:func:`~cachefs.base.early_start.start_detached`)."""
    proc = started if started is not None else start_detached(argv, log_path, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            raise _EXIT_ERRORS.get(rc, CacheFSError)(_last_error(log_path, mountpoint))
        if is_fuse_mount(mountpoint):
            state = holder_state(cache_dir, mountpoint) if cache_dir else {"state": "serving"}
            if state and state.get("state") in ("serving", "failing"):
                return proc
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise CacheFSError(f"mount {mountpoint}: not served after {timeout:.0f} s (log {log_path})")


def _last_error(log_path: str, mountpoint: str) -> str:
    """The reason a holder gave up: its log's last ``cachefs: error:`` line (without the prefix)."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().strip().splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        if line.startswith("cachefs: error: "):
            return line[len("cachefs: error: "):]
    return f"mount {mountpoint} failed: {lines[-1] if lines else '(no output)'}"

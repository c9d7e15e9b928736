"""A child process started before it is needed, so that its start-up (Python's imports: half a second for a FUSE
daemon) overlaps the parent's own work, and told to go on, or to leave, through a pipe."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping

__all__ = ["GO_ENV", "EarlyChild", "start_detached", "wait_for_go"]

#: A pipe descriptor the child reads one byte from before it goes on (end of file: it is not needed).
GO_ENV = "CACHEFS_GO_FD"


class EarlyChild:
    """``argv`` started now; it waits in :func:`wait_for_go` until :meth:`go` or :meth:`cancel`."""

    def __init__(self, argv: list[str]) -> None:
        r, self._go = os.pipe()
        try:
            self.proc = subprocess.Popen(argv, pass_fds=(r,), env={**os.environ, GO_ENV: str(r)})
        except BaseException:
            os.close(self._go)
            raise
        finally:
            os.close(r)

    def go(self, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Let it go on, with ``env`` added to its environment (what the parent learnt after starting it: an
        adopted mount's credentials; through the pipe, never on a command line); the process."""
        try:
            os.write(self._go, b"g" + (json.dumps(dict(env)).encode() if env else b""))
        except BrokenPipeError:  # it died meanwhile: its exit code says why
            pass
        finally:
            os.close(self._go)
        return self.proc

    def cancel(self) -> None:
        """Not needed: it exits without going on."""
        os.close(self._go)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_for_go() -> bool:
    """In a child started as an :class:`EarlyChild`: wait until the parent says go (True; what it adds to the
    environment is added) or cancels (False). True at once in a process started otherwise."""
    go = os.environ.pop(GO_ENV, "")
    if not go:
        return True
    fd = int(go)
    said = bytearray()
    try:
        while chunk := os.read(fd, 65536):  # (until the parent closes its end)
            said += chunk
    finally:
        os.close(fd)
    if said[:1] != b"g":
        return False
    if len(said) > 1:
        os.environ.update(json.loads(said[1:]))
    return True


def start_detached(argv: list[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``argv`` in a session of its own (a terminal's ctrl-c does not reach it), its output appended to
    ``log_path``."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env,
                                start_new_session=True)

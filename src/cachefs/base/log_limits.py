"""Log lines that others can cause, bounded: what a client sends must not decide how much a node writes.

A peer that sends malformed requests, or opens connections until the process runs out of descriptors, would
otherwise get one log line (often with a traceback) per attempt. :class:`RateLimit` is a logging filter that lets
each kind of line (logger and message template) through at a steady rate with a small burst, counts what it
holds back and says so on the next line it lets through; for client errors it drops the traceback (the message
names the error; a traceback of the HTTP parser helps no one).
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimit", "limit_logs"]

#: Loggers that write a line per client mistake: aiohttp's server ("Error handling request" for a bad request
#: line or header), asyncio's (accept() failing while descriptors run out) and our peer server's refusals.
CLIENT_DRIVEN = ("aiohttp.server", "aiohttp.web", "asyncio", "cachefs.agent.peer_server")


class RateLimit(logging.Filter):
    """At most ``per_second`` lines of one kind on average, ``burst`` at once; records of client errors lose
    their traceback."""

    def __init__(self, per_second: float = 1.0, burst: int = 5) -> None:
        super().__init__()
        self.per_second, self.burst = per_second, burst
        self._buckets: dict[tuple[str, str], list[float]] = {}  # kind → [tokens, last refill]
        self._held: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self.passed = self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.get(kind)
            if bucket is None:
                if len(self._buckets) > 10_000:  # many distinct templates: start over rather than grow
                    self._buckets.clear()
                bucket = self._buckets[kind] = [float(self.burst), now]
            bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.per_second)
            bucket[1] = now
            if bucket[0] < 1.0:
                self._held[kind] = self._held.get(kind, 0) + 1
                self.held += 1
                return False
            bucket[0] -= 1.0
            held = self._held.pop(kind, 0)
            self.passed += 1
        if record.exc_info and _is_client_error(record.exc_info[1]):
            err = record.exc_info[1]
            what = " ".join(str(err).split())[:200]  # one line, however the error's text is laid out
            record.msg, record.args = f"{record.getMessage()}: {type(err).__name__}: {what}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"  # the client's mistake, not ours
        if held:
            record.msg, record.args = f"{record.getMessage()} ({held} more like this not logged)", ()
        return True


def _is_client_error(err: BaseException | None) -> bool:
    """What a client caused: a malformed request, a connection it dropped, descriptors it used up."""
    from aiohttp.http_exceptions import HttpProcessingError

    return isinstance(err, HttpProcessingError | ConnectionError | TimeoutError) or (
        isinstance(err, OSError) and err.errno in (23, 24, 105))  # ENFILE, EMFILE, ENOBUFS


_installed: RateLimit | None = None


def limit_logs(per_second: float = 1.0, burst: int = 5) -> RateLimit:
    """Install one :class:`RateLimit` on the loggers clients can drive (once per process); returns it."""
    global _installed
    if _installed is None:
        _installed = RateLimit(per_second, burst)
        for name in CLIENT_DRIVEN:
            logging.getLogger(name).addFilter(_installed)
    return _installed

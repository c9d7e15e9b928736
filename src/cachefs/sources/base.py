"""Where missing bytes come from.

A :class:`Source` lists a dataset once (for its manifest) and serves ranged reads of one *version* of one
object. A read must either return exactly the requested bytes of that version or raise: a
:class:`~cachefs.base.errors.StaleObjectError` when the object has changed, another
:class:`~cachefs.base.errors.CacheFSError` otherwise. Retrying transient failures is the source's job
(:class:`RetryingSource` wraps every origin), so the engine above sees one clean outcome per request.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from cachefs.base.errors import CacheFSError, TruncatedBodyError, translate_origin_error
from cachefs.base.metrics import ORIGIN_REQUESTS, ORIGIN_RETRIES, ORIGIN_SECONDS, result_of, safely
from cachefs.base.types import Entry

__all__ = ["RetryPolicy", "RetryingSource", "Source", "with_retries"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Source(abc.ABC):
    """Lists datasets and reads byte ranges of object versions."""

    #: True when :meth:`read` itself detects a changed object (S3 If-Match, local mtime check).
    verifies_version: bool = True
    #: True when :meth:`list_directory` lists one directory (a mount may then answer before the whole tree is
    #: listed).
    lists_directories: bool = False

    @abc.abstractmethod
    def list_tree(self, root_url: str) -> AsyncIterator[list[Entry]]:
        """Yield batches of the *files* under ``root_url`` (paths relative to it, ``/``-separated).

        Raises :class:`~cachefs.base.errors.ObjectNotFoundError` when the root does not exist at all.
        """

    @abc.abstractmethod
    async def stat(self, url: str) -> Entry:
        """The current entry of one object (``path`` is the full URL)."""

    def list_directory(self, root_url: str, path: str) -> AsyncIterator[tuple[list[Entry], list[str]]]:
        """One directory of the tree under ``root_url``, page by page as the origin sends it: each page's files
        (paths relative to the root) and names of subdirectories. A caller writes a page down before asking for the
        next, so a directory of millions costs one page of memory. Only where :attr:`lists_directories`."""
        raise NotImplementedError(f"{type(self).__name__} lists whole trees only")

    @abc.abstractmethod
    async def read(self, url: str, version: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of ``version`` of the object at ``url``; exactly ``end - start`` bytes (a
        ``bytearray`` where the body was received straight into one)."""

    @abc.abstractmethod
    async def write(self, url: str, data: bytes) -> Entry:
        """Replace the whole object at ``url`` with ``data`` (readers see the old object or the new one); its new
        entry."""

    async def connect(self) -> None:  # noqa: B027 - optional hook
        """Set up the client (sessions, credentials) ahead of the first read; sends no request."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class RetryPolicy:
    """Exponential backoff with full jitter (AWS's recommendation for contended retries)."""

    def __init__(self, max_attempts: int, base: float, cap: float) -> None:
        self.max_attempts = max_attempts
        self.base = base
        self.cap = cap

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap, self.base * (2**attempt)))


async def with_retries(
    call: Callable[[], Awaitable[T]], *, what: str, policy: RetryPolicy, timeout: float | None = None,
    kind: str = "other",
) -> T:
    """Run ``call`` until it succeeds, fails with a non-retryable error, or runs out of attempts.

    Every failure is translated into the cachefs tree once, here; every attempt is counted (``kind``: get,
    head, list, put, connect) with its result and time, every retry with its reason.
    """
    attempt = 0
    while True:
        started = time.perf_counter()
        try:
            got = await (call() if timeout is None else asyncio.wait_for(call(), timeout))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            err = exc if isinstance(exc, CacheFSError) else translate_origin_error(exc, what)
            _count(kind, result_of(err), started)
            attempt += 1
            if not err.retryable or attempt >= policy.max_attempts:
                if err is exc:
                    raise
                raise err from exc
            delay = policy.delay(attempt)
            log.debug("retrying %s after %s (attempt %d, sleeping %.3fs)", what, type(err).__name__, attempt, delay)
            safely(ORIGIN_RETRIES.labels(result_of(err)).inc)
            await asyncio.sleep(delay)
            continue
        _count(kind, "ok", started)
        return got


def _count(kind: str, result: str, started: float) -> None:
    seconds = time.perf_counter() - started

    def update() -> None:
        ORIGIN_SECONDS.labels(kind).observe(seconds)
        ORIGIN_REQUESTS.labels(kind, result).inc()

    safely(update)


class RetryingSource(Source):
    """Adds timeouts, retries with backoff, the body-length check and error translation to a source whose
    ``read``/``stat`` make one attempt each. Listing retries per page inside the source itself."""

    def __init__(self, inner: Source, policy: RetryPolicy, timeout: float) -> None:
        self.inner = inner
        self.policy = policy
        self.timeout = timeout
        self.verifies_version = inner.verifies_version

    def list_tree(self, root_url: str) -> AsyncIterator[list[Entry]]:
        return self.inner.list_tree(root_url)

    @property
    def lists_directories(self) -> bool:  # type: ignore[override]
        return self.inner.lists_directories

    def list_directory(self, root_url: str, path: str) -> AsyncIterator[tuple[list[Entry], list[str]]]:
        return self.inner.list_directory(root_url, path)  # (each page is retried where it is asked for)

    async def stat(self, url: str) -> Entry:
        return await with_retries(lambda: self.inner.stat(url), what=url, policy=self.policy, timeout=self.timeout,
                                  kind="head")

    async def read(self, url: str, version: str, start: int, end: int) -> bytes | bytearray:
        if end <= start:
            return b""

        async def attempt() -> bytes | bytearray:
            data = await self.inner.read(url, version, start, end)
            if len(data) != end - start:
                raise TruncatedBodyError(f"{url} [{start}, {end}): got {len(data)} of {end - start} bytes")
            return data

        return await with_retries(attempt, what=url, policy=self.policy, timeout=self.timeout, kind="get")

    async def write(self, url: str, data: bytes) -> Entry:
        return await with_retries(lambda: self.inner.write(url, data), what=url, policy=self.policy,
                                  timeout=self.timeout + len(data) / (10 * 1024 * 1024), kind="put")

    async def connect(self) -> None:
        await self.inner.connect()

    async def close(self) -> None:
        await self.inner.close()

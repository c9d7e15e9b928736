"""A source wrapper that injects origin faults, the one place tests get faults they cannot cause for real.

Faults are raised *below* :class:`~cachefs.sources.RetryingSource`, in the raw shapes the real stack
produces (botocore ``ClientError`` with S3 codes, hung requests, short bodies, dropped connections), so the
production retry, timeout, length-check and error-translation code is what gets exercised.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from cachefs.base.types import Entry
from cachefs.sources import Source

__all__ = ["FAULTS", "FailingSource"]

FAULTS = ("throttle", "server_error", "timeout", "truncate", "disconnect", "forbidden", "missing")


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


class FailingSource(Source):
    """Wraps ``inner``; each read takes the next planned fault (if any) before touching the origin."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.verifies_version = inner.verifies_version
        self.planned: deque[str] = deque()
        self.reads = 0
        self.read_ranges: list[tuple[str, int, int]] = []
        #: Awaited before every read reaches the origin (e.g. to change the object mid-read).
        self.before_read: Callable[[str, int, int], Awaitable[None]] | None = None
        #: Extra latency per read, seconds.
        self.delay = 0.0

    def plan(self, *faults: str) -> None:
        for f in faults:
            if f not in FAULTS:
                raise ValueError(f"unknown fault {f!r}")
        self.planned.extend(faults)

    def list_tree(self, root_url: str) -> AsyncIterator[list[Entry]]:
        return self.inner.list_tree(root_url)

    async def stat(self, url: str) -> Entry:
        return await self.inner.stat(url)

    async def write(self, url: str, data: bytes) -> Entry:
        return await self.inner.write(url, data)

    async def read(self, url: str, version: str, start: int, end: int) -> bytes | bytearray:
        self.reads += 1
        self.read_ranges.append((url, start, end))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.before_read is not None:
            await self.before_read(url, start, end)
        fault = self.planned.popleft() if self.planned else None
        if fault == "throttle":
            raise _client_error("SlowDown", 503)
        if fault == "server_error":
            raise _client_error("InternalError", 500)
        if fault == "forbidden":
            raise _client_error("AccessDenied", 403)
        if fault == "missing":
            raise _client_error("NoSuchKey", 404)
        if fault == "timeout":
            await asyncio.sleep(3600)
        if fault == "disconnect":
            import aiohttp

            raise aiohttp.ClientPayloadError("Response payload is not completed")
        data = await self.inner.read(url, version, start, end)
        if fault == "truncate":
            return data[: len(data) // 2]
        return data

    async def close(self) -> None:
        await self.inner.close()

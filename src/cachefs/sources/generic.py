"""Any other fsspec protocol (``gs://``, ``az://``, ``http(s)://``, ``memory://``, …).

Versions come from whatever the backend reports (ETag, generation, md5, else mtime+size). Backends give us
no conditional GET through fsspec's common API, so a read re-stats the object the first time this process
reads it and raises ``StaleObjectError`` if it changed; later changes within the same process are caught
only by the S3 and file origins (see docs/SEMANTICS.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from cachefs.base.config import OriginConfig
from cachefs.base.errors import StaleObjectError
from cachefs.base.types import Entry
from cachefs.sources.base import RetryPolicy, Source, with_retries

__all__ = ["FsspecSource"]

_VERSION_KEYS = ("ETag", "etag", "generation", "version_id", "VersionId", "md5Hash", "md5", "checksum")


def info_version(info: dict[str, Any]) -> str:
    for key in _VERSION_KEYS:
        if info.get(key):
            return str(info[key]).strip('"')
    return f"{info_mtime(info)}-{info.get('size')}"


def info_mtime(info: dict[str, Any]) -> float:
    raw: Any = info.get("mtime") or info.get("LastModified") or info.get("updated") or info.get("created")
    if hasattr(raw, "timestamp"):
        return float(raw.timestamp())
    try:
        return float(raw)
    except (TypeError, ValueError):
        return 0.0


class FsspecSource(Source):
    verifies_version = False

    def __init__(self, protocol: str, origin: OriginConfig, storage_options: dict[str, Any] | None = None, *,
                 url: str = "") -> None:
        """``url``: a URL of the origin, whose host, port or user go to the file system as fsspec's own URL handling
        would pass them (``ftp://host/…``, ``sftp://user@host/…``)."""
        import fsspec

        self._protocol = protocol
        cls = fsspec.get_filesystem_class(protocol)
        opts = {**(cls._get_kwargs_from_urls(url) if url else {}), **(storage_options or {})}
        if getattr(cls, "async_impl", False):
            opts.setdefault("asynchronous", True)
        opts.setdefault("skip_instance_cache", True)
        self._fs = cls(**opts)
        self._async = getattr(cls, "async_impl", False)
        self._policy = RetryPolicy(origin.max_attempts, origin.backoff_base, origin.backoff_max)
        self._checked: dict[str, str] = {}

    async def _call(self, name: str, *args, **kwargs):
        if self._async:
            return await getattr(self._fs, "_" + name)(*args, **kwargs)
        return await asyncio.to_thread(getattr(self._fs, name), *args, **kwargs)

    def _strip(self, url: str) -> str:
        return self._fs._strip_protocol(url)

    async def list_tree(self, root_url: str) -> AsyncIterator[list[Entry]]:
        root = self._strip(root_url).rstrip("/")
        found = await with_retries(
            lambda: self._call("find", root, detail=True), what=f"list {root_url}", policy=self._policy, kind="list"
        )
        batch = []
        for name, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = name[len(root):].lstrip("/")
            batch.append(Entry(rel, int(info.get("size") or 0), info_version(info), info_mtime(info)))
        if batch:
            yield batch
        else:  # nothing found: say why (find, like exists, takes an unreachable server for an empty tree)
            await with_retries(lambda: self._call("info", root), what=f"list {root_url}", policy=self._policy,
                               kind="head")

    async def close(self) -> None:
        """Close the backend's HTTP session, if it keeps one (http, gcs, …)."""
        for attr in ("_session", "session"):
            session = getattr(self._fs, attr, None)
            close = getattr(session, "close", None)
            if close is not None and asyncio.iscoroutinefunction(close) and not getattr(session, "closed", True):
                await close()

    async def stat(self, url: str) -> Entry:
        info = await self._call("info", self._strip(url))
        return Entry(url, int(info.get("size") or 0), info_version(info), info_mtime(info))

    async def write(self, url: str, data: bytes) -> Entry:
        await self._call("pipe_file", self._strip(url), data)
        return await self.stat(url)

    async def read(self, url: str, version: str, start: int, end: int) -> bytes:
        if version and self._checked.get(url) != version:
            current = await self.stat(url)
            if current.version != version:
                raise StaleObjectError(f"{url}: changed since the manifest was taken")
            self._checked[url] = version
        return await self._call("cat_file", self._strip(url), start=start, end=end)

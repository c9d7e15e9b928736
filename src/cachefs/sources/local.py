"""The ``file://`` origin: a directory tree on a local or network filesystem.

The version of a file is ``<mtime_ns>-<size>-<inode>``; a read re-checks it with ``fstat`` on the open
descriptor, so a file replaced or rewritten since the manifest was taken raises ``StaleObjectError``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from cachefs.base.errors import ObjectNotFoundError, StaleObjectError, translate_origin_error
from cachefs.base.files import atomic_write
from cachefs.base.types import Entry
from cachefs.sources.base import Source

__all__ = ["LocalSource"]

_BATCH = 2000


def _path(url: str) -> str:
    return url.split("://", 1)[1] if "://" in url else url


def _version(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns}-{st.st_size}-{st.st_ino}"


class LocalSource(Source):
    verifies_version = True

    async def list_tree(self, root_url: str) -> AsyncIterator[list[Entry]]:
        root = _path(root_url)
        if not os.path.isdir(root):
            raise ObjectNotFoundError(f"{root_url}: no such directory")
        queue: asyncio.Queue = asyncio.Queue(maxsize=16)
        loop = asyncio.get_running_loop()

        def walk() -> None:
            try:
                batch: list[Entry] = []
                for dirpath, _dirs, files in os.walk(root):
                    rel = os.path.relpath(dirpath, root)
                    rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                    for name in files:
                        try:
                            st = os.stat(os.path.join(dirpath, name))
                        except FileNotFoundError:
                            continue  # removed while we listed
                        batch.append(Entry(rel + name, st.st_size, _version(st), st.st_mtime))
                        if len(batch) >= _BATCH:
                            asyncio.run_coroutine_threadsafe(queue.put(batch), loop).result()
                            batch = []
                if batch:
                    asyncio.run_coroutine_threadsafe(queue.put(batch), loop).result()
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                asyncio.run_coroutine_threadsafe(queue.put(exc), loop).result()
            asyncio.run_coroutine_threadsafe(queue.put(None), loop).result()

        fut = loop.run_in_executor(None, walk)
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise translate_origin_error(item, root_url)
            yield item
        await fut

    async def stat(self, url: str) -> Entry:
        try:
            st = await asyncio.to_thread(os.stat, _path(url))
        except OSError as exc:
            raise translate_origin_error(exc, url) from exc
        return Entry(url, st.st_size, _version(st), st.st_mtime)

    async def read(self, url: str, version: str, start: int, end: int) -> bytes:
        return await asyncio.to_thread(self._read, url, version, start, end)

    async def write(self, url: str, data: bytes) -> Entry:
        def put() -> os.stat_result:
            path = _path(url)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # Readers see the old object or the new one, never half of one; a written object survives a crash.
            atomic_write(path, data, fsync=True, mode=0o644)
            return os.stat(path)

        try:
            st = await asyncio.to_thread(put)
        except OSError as exc:
            raise translate_origin_error(exc, url) from exc
        return Entry(url, st.st_size, _version(st), st.st_mtime)

    @staticmethod
    def _read(url: str, version: str, start: int, end: int) -> bytes:
        try:
            fd = os.open(_path(url), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and version:
                raise StaleObjectError(f"{url}: removed since the manifest was taken") from exc
            raise translate_origin_error(exc, url) from exc
        try:
            if version and _version(os.fstat(fd)) != version:
                raise StaleObjectError(f"{url}: changed since the manifest was taken")
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

"""Copies of other members' checkpoint files, held until their upload: the peer server's replica routes.

A writable volume's daemon on another member sends each file it closes here before its ``close`` returns
(``checkpoint.replicas``), so a checkpoint acknowledged to a training job survives the loss of the node that wrote
it; once the file is on the origin the writer drops the copy. A node that mounts the volume meanwhile lists the
copies and reads them from here (restore before the upload finished).

``PUT /v1/replica/{volume}/{entry}?url=…&key=…``
    store the body (its xxh3 in ``X-Cachefs-Xxh3``, checked) as entry ``entry`` of the volume whose id
    (``dataset_id(url)``) is ``volume``; fsynced before the 200. 413 past ``checkpoint.staging_limit`` on this node.
``GET /v1/replicas/{volume}``
    the entries held: ``[{"entry", "key", "size", "writer"}]``.
``GET /v1/replica/{volume}/{entry}``
    the bytes, with their xxh3. ``POST …?key=…`` re-keys it (renamed before its upload); ``DELETE`` drops it.

Paths never come from the request: entries are numbers, volumes ids, keys checked as dataset-relative paths.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time

from aiohttp import web

from cachefs.base.checksum import block_hasher
from cachefs.base.files import atomic_write
from cachefs.base.types import dataset_id
from cachefs.cluster.peer_client import CHECKSUM_HEADER
from cachefs.manifest import valid_relpath

__all__ = ["ReplicaHandlers", "ReplicaStore"]

log = logging.getLogger(__name__)

_VOLUME = re.compile(r"[0-9a-f]{16}")
_ENTRY = re.compile(r"[0-9]{1,15}")
_MAX_URL = 4096
#: Seconds a replica's body may go without a byte before the upload is dropped.
BODY_STALL = 30.0


class ReplicaStore:
    """``<cache>/replicas/<volume>/<entry>`` (the bytes) and ``<entry>.json`` (url, key, size, writer, xxh3)."""

    def __init__(self, cache_dir: str, limit: int) -> None:
        self.root = os.path.join(cache_dir, "replicas")
        self.limit = limit
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def _path(self, volume: str, entry: str) -> str:
        return os.path.join(self.root, volume, entry)

    def held_bytes(self) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(self.root):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if not f.endswith(".json"))
        return total

    def meta(self, volume: str, entry: str) -> dict | None:
        try:
            with open(self._path(volume, entry) + ".json") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def listing(self, volume: str) -> list[dict]:
        d = os.path.join(self.root, volume)
        out = []
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            if name.endswith(".json"):
                meta = self.meta(volume, name[:-5])
                if meta is not None:
                    out.append({"entry": name[:-5], "key": meta["key"], "size": meta["size"],
                                "writer": meta.get("writer", "")})
        return out

    def drop(self, volume: str, entry: str) -> bool:
        found = False
        for path in (self._path(volume, entry) + ".json", self._path(volume, entry)):
            try:
                os.unlink(path)
                found = True
            except FileNotFoundError:
                pass
        return found

    def rekey(self, volume: str, entry: str, key: str) -> bool:
        meta = self.meta(volume, entry)
        if meta is None:
            return False
        meta["key"] = key
        atomic_write(self._path(volume, entry) + ".json", json.dumps(meta), fsync=True)
        return True

    def data_path(self, volume: str, entry: str) -> str | None:
        path = self._path(volume, entry)
        return path if os.path.exists(path + ".json") else None


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReplicaHandlers:
    """The routes above, over one store (the peer server authenticates every ``/v1/`` request first)."""

    def __init__(self, store: ReplicaStore) -> None:
        self.store = store
        self._room = asyncio.Lock()  # one body admitted against the limit at a time

    def routes(self, app: web.Application) -> None:
        app.router.add_put("/v1/replica/{volume}/{entry}", self.put)
        app.router.add_get("/v1/replica/{volume}/{entry}", self.get)
        app.router.add_post("/v1/replica/{volume}/{entry}", self.rekey)
        app.router.add_delete("/v1/replica/{volume}/{entry}", self.drop)
        app.router.add_get("/v1/replicas/{volume}", self.listing)

    @staticmethod
    def _ids(request: web.Request) -> tuple[str, str] | web.Response:
        volume, entry = request.match_info["volume"], request.match_info.get("entry", "0")
        if not _VOLUME.fullmatch(volume) or not _ENTRY.fullmatch(entry):
            return web.json_response({"error": "not a volume id and entry number"}, status=400)
        return volume, entry

    async def put(self, request: web.Request) -> web.Response:
        ids = self._ids(request)
        if isinstance(ids, web.Response):
            return ids
        volume, entry = ids
        url, key = request.query.get("url", ""), request.query.get("key", "")
        if not url or len(url) > _MAX_URL or not url.isprintable() or "://" not in url or dataset_id(url) != volume:
            return web.json_response({"error": "url: not the URL of that volume"}, status=400)
        why = valid_relpath(key)
        if why:
            return web.json_response({"error": f"key: {why}"}, status=400)
        size = request.content_length
        try:
            checksum = int(request.headers.get(CHECKSUM_HEADER, ""), 16)
        except ValueError:
            return web.json_response({"error": "no checksum with the replica"}, status=400)
        if size is None:
            return web.json_response({"error": "a replica needs its Content-Length"}, status=411)
        async with self._room:
            held = await asyncio.to_thread(self.store.held_bytes)
            if held + size > self.store.limit:
                return web.json_response({"error": f"this member holds {held} bytes of replicas; {size} more would "
                                                   f"pass its staging limit ({self.store.limit})"}, status=413)
            path = self.store._path(volume, entry)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            tmp = f"{path}.part"
            hasher, got = block_hasher(), 0
            with open(tmp, "wb") as f:
                while True:
                    try:
                        chunk = await asyncio.wait_for(request.content.readany(), BODY_STALL)
                    except TimeoutError:
                        os.unlink(tmp)
                        raise web.HTTPRequestTimeout(text=f"the body stalled for {BODY_STALL:.0f} s") from None
                    if not chunk:
                        break
                    got += len(chunk)
                    if got > size:
                        break
                    hasher.update(chunk)
                    await asyncio.to_thread(f.write, chunk)
                await asyncio.to_thread(os.fsync, f.fileno())
            if got != size or hasher.intdigest() != checksum:
                os.unlink(tmp)
                return web.json_response({"error": "the replica's bytes do not match its length and checksum"},
                                         status=400)
            os.replace(tmp, path)
            meta = {"url": url, "key": key, "size": size, "xxh3": f"{checksum:016x}", "writer": request["member"],
                    "time": time.time()}
            await asyncio.to_thread(atomic_write, path + ".json", json.dumps(meta), fsync=True)
        log.info("holding %s/%s (%d bytes) for %s until its upload", url, key, size, request["member"])
        return web.json_response({"ok": True})

    async def get(self, request: web.Request) -> web.StreamResponse:
        ids = self._ids(request)
        if isinstance(ids, web.Response):
            return ids
        path = self.store.data_path(*ids)
        meta = self.store.meta(*ids)
        if path is None or meta is None:
            return web.json_response({"error": "not here"}, status=404)
        return web.FileResponse(path, headers={CHECKSUM_HEADER: meta["xxh3"]})

    async def rekey(self, request: web.Request) -> web.Response:
        ids = self._ids(request)
        if isinstance(ids, web.Response):
            return ids
        key = request.query.get("key", "")
        why = valid_relpath(key)
        if why:
            return web.json_response({"error": f"key: {why}"}, status=400)
        if not await asyncio.to_thread(self.store.rekey, *ids, key):
            return web.json_response({"error": "not here"}, status=404)
        return web.json_response({"ok": True})

    async def drop(self, request: web.Request) -> web.Response:
        ids = self._ids(request)
        if isinstance(ids, web.Response):
            return ids
        if not await asyncio.to_thread(self.store.drop, *ids):
            return web.json_response({"error": "not here"}, status=404)
        return web.json_response({"ok": True})

    async def listing(self, request: web.Request) -> web.Response:
        volume = request.match_info["volume"]
        if not _VOLUME.fullmatch(volume):
            return web.json_response({"error": "not a volume id"}, status=400)
        return web.json_response(await asyncio.to_thread(self.store.listing, volume))

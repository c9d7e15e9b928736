"""The peer server: what this node serves the other members of its cache group.

``GET /v1/block/{dataset id}?path=…&version=…&block=N``
    one block of a large file, ``GET /v1/small/{dataset id}?path=…&version=…`` a whole small file: from this
    node's cache, or, when this node owns the key (:mod:`cachefs.cluster.placement`), fetched from the origin
    once for the whole group first. With ``X-Cachefs-Xxh3``, the checksum recorded when the bytes were fetched.
``GET /v1/manifest/{dataset id}``
    the dataset's current manifest (:mod:`cachefs.manifest.shipping`), so a member lists the bucket only once.
``?replica=1``
    the reader chose this node as a replica of a hot key (:mod:`cachefs.tiers.peer`): any of the key's
    candidates fetches it then, from the owner (never from the origin first), and keeps it.
``POST /v1/evict/{dataset id}?url=…``
    drop what this node caches of the dataset (``cachefs evict --group``, a purge; docs/SECURITY.md).
``PUT|GET|POST|DELETE /v1/replica/…``, ``GET /v1/replicas/…``
    copies of other members' checkpoint files until their upload (:mod:`cachefs.agent.replicas`).
``GET /v1/info``, ``/healthz``, ``/readyz``
    this member's name and weight; liveness; readiness (membership known).

What a request may reach is what the node's manifests name: a file is looked up by its dataset-relative path and
version in a manifest of a dataset the node knows, never opened by a path from the request, so traversal and
other names lead nowhere (400 for names no manifest could hold, 404 for the rest). Only bytes the index records
as present are sent: a hole in a cache file is never served as zeros. Every request must carry a member's token
(:mod:`cachefs.cluster.auth`): 401 without a valid one, 403 for a node outside the group.

What a client gets wrong is a 4xx naming it, never a 500: a bad URL, path, version or block number is a 400; a
manifest push over ``cluster.max_manifest_push`` a 413 before its body is read (pushes are taken one at a time,
and a body that stalls for :data:`BODY_STALL` seconds is dropped); a token the API server cannot check right now
a 503 with Retry-After; trouble with the origin or this node's disk a 503. Every answer is counted by route and
status class (``cachefs_peer_requests_total``), and refusals are logged at a bounded rate
(:mod:`cachefs.base.log_limits`).

Every answer is counted against its directory (:class:`~cachefs.cluster.heat.HeatTracker`); an answer of a
hot directory says how many replicas its keys have (``X-Cachefs-Hot``), and readers spread over them.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from aiohttp import web

from cachefs.agent.replicas import ReplicaHandlers, ReplicaStore
from cachefs.agent.serving import GroupServing
from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CacheFSError, InvalidURLError, ObjectNotFoundError
from cachefs.base.metrics import PEER_REQUESTS, safely
from cachefs.base.types import Entry, dataset_id, object_key
from cachefs.cluster.auth import Forbidden, ReviewUnavailable, Unauthorized
from cachefs.cluster.heat import HOT_HEADER, HeatTracker
from cachefs.cluster.keys import ASKED_AS_REPLICA, ASKED_BY, OWNERS_THAT_FETCH, DirectoryWindows, block_key
from cachefs.cluster.membership import MemberTable
from cachefs.cluster.peer_client import CHECKSUM_HEADER, MEMBER_HEADER
from cachefs.cluster.placement import RANK
from cachefs.cluster.tls import has_group_certificate
from cachefs.manifest import valid_relpath
from cachefs.manifest.dataset import Dataset

__all__ = ["PeerHandlers", "make_peer_app"]

log = logging.getLogger(__name__)

_DATASET = re.compile(r"[0-9a-f]{16}")
#: The largest manifest a member may push by default (cluster.max_manifest_push; 2.5 million files or so).
MAX_MANIFEST = 256 << 20
#: Seconds a manifest push may go without sending a byte of its body before it is dropped.
BODY_STALL = 30.0
_MAX_VERSION = 1024
_MAX_URL = 4096


def _bad(why: str) -> web.Response:
    return web.json_response({"error": why}, status=400)


def _url_problem(url: str, ds_id: str) -> str:
    """Why ``url`` cannot name dataset ``ds_id`` ("" if it can; an empty URL names none and is fine)."""
    if not url:
        return ""
    if len(url) > _MAX_URL or not url.isprintable():
        return "url: malformed"
    try:
        if dataset_id(url) != ds_id:
            return "url: not the URL of that dataset"
    except InvalidURLError as exc:
        return f"url: {exc}"
    return ""


def _route(request: web.Request) -> str:
    """The route's name for the metrics: its first two path parts (``/v1/block``), never a client's string."""
    resource = request.match_info.route.resource
    if resource is None:
        return "unknown"
    return "/".join(resource.canonical.split("/")[:3])


class PeerHandlers:
    """The peer server's handlers. ``verifier.identify(token, claimed member) -> Identity`` checks tokens;
    ``ready()`` says whether membership is known (``/readyz``); ``heat`` counts answers per directory; with ``tls``
    (served over the group's TLS) every ``/v1/`` request must come with the group's client certificate."""

    def __init__(self, serving: GroupServing, table: MemberTable, verifier, *, weight: float = 1.0,
                 ready: Callable[[], bool] = lambda: True, heat: HeatTracker | None = None, tls: bool = False,
                 max_manifest: int = MAX_MANIFEST) -> None:
        self.serving, self.table, self.verifier, self.weight = serving, table, verifier, weight
        self.ready, self.heat, self.tls = ready, heat, tls
        self.windows = DirectoryWindows()
        self.max_manifest = max_manifest
        self._push_lock = asyncio.Lock()  # one pushed manifest in memory at a time

    @web.middleware
    async def answer_errors(self, request: web.Request, handler):
        """Our errors become the status they stand for, once, here; every answer is counted."""
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            response = exc
        except ObjectNotFoundError as exc:
            response = web.json_response({"error": str(exc)}, status=404)
        except InvalidURLError as exc:
            response = _bad(str(exc))
        except ReviewUnavailable as exc:
            response = web.json_response({"error": str(exc)}, status=503, headers={"Retry-After": "5"})
        except (CacheFSError, OSError) as exc:  # the origin or this node's disk, not the request
            log.warning("%s %s: %s", request.method, _route(request), exc)
            response = web.json_response({"error": str(exc)}, status=503, headers={"Retry-After": "1"})
        status = response.status
        if status in (401, 403, 413):
            log.warning("refused %s %s from %s: %d", request.method, _route(request), request.remote, status)
        elif status == 400:
            log.info("bad request %s %s from %s", request.method, _route(request), request.remote)
        safely(PEER_REQUESTS.labels(_route(request), f"{status // 100}xx").inc)
        return response

    @web.middleware
    async def authenticate(self, request: web.Request, handler):
        if not request.path.startswith("/v1/"):
            return await handler(request)
        if self.tls and not has_group_certificate(request.transport):
            return web.json_response({"error": "no client certificate of the cache group"}, status=401)
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        try:
            who = await self.verifier.identify(token, request.headers.get(MEMBER_HEADER, ""))
            if self.table.member(who.node) is None:
                raise Forbidden(f"{who.node} is not a member of this cache group")
        except Unauthorized as exc:
            return web.json_response({"error": str(exc)}, status=401)
        except Forbidden as exc:
            return web.json_response({"error": str(exc)}, status=403)
        request["member"] = who.node
        return await handler(request)

    # -- requests for bytes ---------------------------------------------------------------------------------
    @staticmethod
    def _args(request: web.Request, *, block: bool) -> tuple[str, str, str, str, int | None] | web.Response:
        ds_id = request.match_info["dataset"]
        q = request.query
        path, version, url = q.get("path", ""), q.get("version", ""), q.get("url", "")
        if not _DATASET.fullmatch(ds_id):
            return _bad("not a dataset id")
        why = valid_relpath(path)
        if why:
            return _bad(f"path: {why}")
        if not version or len(version) > _MAX_VERSION or not version.isprintable():
            return _bad("version: missing or malformed")
        why = _url_problem(url, ds_id)
        if why:
            return _bad(why)
        if not block:
            return ds_id, url, path, version, None
        raw = q.get("block", "")
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 10:
            return _bad("block: not a block number")
        return ds_id, url, path, version, int(raw)

    def _fetches(self, request: web.Request, key: bytes) -> bool:
        """Whether to fetch what is not here: asked to (not a hedge), and this node is among the key's owners,
        or among its candidates when asked as a replica."""
        if request.query.get("fetch", "1") == "0":
            return False
        replica = request.query.get("replica", "0") == "1"
        return self.table.self_name in self.table.placement.owners(key, RANK if replica else OWNERS_THAT_FETCH)

    def _answer(self, answer: tuple[bytes, int] | None, ds_id: str, path: str) -> web.Response:
        if answer is None:
            return web.json_response({"error": "not here"}, status=404)
        data, checksum = answer
        headers = {CHECKSUM_HEADER: f"{checksum:016x}"}
        if self.heat is not None and (replicas := self.heat.note(ds_id, path.rpartition("/")[0], len(data))):
            headers[HOT_HEADER] = str(replicas)
        return web.Response(body=data, headers=headers, content_type="application/octet-stream")

    async def _bytes(self, request: web.Request, ds: Dataset, entry: Entry, idx: int | None,
                     key: bytes) -> tuple[bytes, int] | None:
        token = ASKED_AS_REPLICA.set(request.query.get("replica", "0") == "1")
        asker = ASKED_BY.set(request["member"])
        try:
            return await self.serving.bytes_for(ds, entry, idx, fetch=self._fetches(request, key))
        finally:
            ASKED_BY.reset(asker)
            ASKED_AS_REPLICA.reset(token)

    async def _file(self, request: web.Request, *, block: bool) -> tuple[Dataset, Entry, int | None] | web.Response:
        got = self._args(request, block=block)
        if isinstance(got, web.Response):
            return got
        ds_id, url, path, version, idx = got
        ds = await self.serving.dataset(ds_id, url)
        entry = self.serving.entry(ds, path, version) if ds is not None else None
        if ds is None or entry is None:
            return web.json_response({"error": "no such file at that version here"}, status=404)
        return ds, entry, idx

    async def block(self, request: web.Request) -> web.Response:
        got = await self._file(request, block=True)
        if isinstance(got, web.Response):
            return got
        ds, entry, idx = got
        assert idx is not None
        if self.serving.engine.strategy(entry).packed or idx * self.serving.engine.block_size >= entry.size:
            return _bad("block: out of range (or a small file: ask /v1/small)")
        key = block_key(object_key(ds.ref.id, entry.path, entry.version), idx)
        return self._answer(await self._bytes(request, ds, entry, idx, key), ds.ref.id, entry.path)

    async def small(self, request: web.Request) -> web.Response:
        got = await self._file(request, block=False)
        if isinstance(got, web.Response):
            return got
        ds, entry, _ = got
        if not self.serving.engine.strategy(entry).packed:
            return _bad("not a small file: ask /v1/block")
        key = self.windows.key(ds, entry.path)
        return self._answer(await self._bytes(request, ds, entry, None, key), ds.ref.id, entry.path)

    # -- manifests ------------------------------------------------------------------------------------------
    async def manifest(self, request: web.Request) -> web.Response:
        ds_id, url = request.match_info["dataset"], request.query.get("url", "")
        if not _DATASET.fullmatch(ds_id):
            return _bad("not a dataset id")
        why = _url_problem(url, ds_id)
        if why:
            return _bad(why)
        got = await self.serving.manifest(ds_id, url)
        if got is None:
            return web.json_response({"error": "no manifest of that dataset here"}, status=404)
        raw, checksum = got
        return web.Response(body=raw, headers={CHECKSUM_HEADER: f"{checksum:016x}"},
                            content_type="application/msgpack")

    async def pushed_manifest(self, request: web.Request) -> web.Response:
        """A member took a new manifest of a dataset (``cachefs refresh``): take it too, if this node knows it."""
        ds_id, url = request.match_info["dataset"], request.query.get("url", "")
        if not _DATASET.fullmatch(ds_id) or not url or _url_problem(url, ds_id):
            return _bad("not a dataset id and its URL")
        too_big = web.json_response({"error": f"a manifest over {self.max_manifest} bytes (cluster.max_manifest_push "
                                              "of this member)"}, status=413)
        if (request.content_length or 0) > self.max_manifest:
            return too_big
        async with self._push_lock:
            raw = await self._body(request)
            if raw is None:
                return too_big
            return await self._take(request, ds_id, url, raw)

    async def _body(self, request: web.Request) -> bytes | None:
        """The request's body, read as it comes (None past the limit); TimeoutError if it stalls."""
        body = bytearray()
        while True:
            try:
                chunk = await asyncio.wait_for(request.content.readany(), BODY_STALL)
            except TimeoutError:
                raise web.HTTPRequestTimeout(text=f"the body stalled for {BODY_STALL:.0f} s") from None
            if not chunk:
                return bytes(body)
            if len(body) + len(chunk) > self.max_manifest:
                return None
            body += chunk

    async def _take(self, request: web.Request, ds_id: str, url: str, raw: bytes) -> web.Response:
        try:
            if int(request.headers.get(CHECKSUM_HEADER, ""), 16) != block_checksum(raw):
                return _bad("the manifest failed its checksum")
        except ValueError:
            return _bad("no checksum with the manifest")
        try:
            took = await self.serving.take_pushed(ds_id, url, raw)
        except CacheFSError as exc:  # not a manifest, or of another dataset
            return _bad(str(exc))
        if not took:
            return web.json_response({"error": "this node does not know that dataset"}, status=404)
        log.info("took a new manifest of %s from %s", url, request["member"])
        return web.json_response({"ok": True})

    async def evict(self, request: web.Request) -> web.Response:
        """A member asks every member to drop a dataset (``cachefs evict --group``: a purge)."""
        ds_id, url = request.match_info["dataset"], request.query.get("url", "")
        if not _DATASET.fullmatch(ds_id) or not url or _url_problem(url, ds_id):
            return _bad("not a dataset id and its URL")
        freed = await self.serving.evict(ds_id)
        if freed is None:
            return web.json_response({"error": "this node does not know that dataset"}, status=404)
        log.warning("evicted %s (%d bytes) at the request of %s", url, freed, request["member"])
        return web.json_response({"freed": freed})

    # -- about this member ----------------------------------------------------------------------------------
    async def info(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.table.self_name, "weight": self.weight})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, request: web.Request) -> web.Response:
        if self.ready():
            return web.Response(text="ok")
        return web.Response(text="membership not known yet", status=503)


def make_peer_app(serving: GroupServing, table: MemberTable, verifier, *, weight: float = 1.0,
                  ready: Callable[[], bool] = lambda: True, heat: HeatTracker | None = None,
                  tls: bool = False, max_manifest: int = MAX_MANIFEST,
                  replicas: ReplicaStore | None = None) -> web.Application:
    """The peer server's application (:class:`PeerHandlers`; with ``replicas``, the replica routes of
    :mod:`cachefs.agent.replicas` too)."""
    h = PeerHandlers(serving, table, verifier, weight=weight, ready=ready, heat=heat, tls=tls,
                     max_manifest=max_manifest)
    # Requests carry no bodies, except a manifest a member pushes after a refresh (read by its handler, bounded).
    app = web.Application(middlewares=[h.answer_errors, h.authenticate], client_max_size=max_manifest)
    app.router.add_get("/v1/block/{dataset}", h.block)
    app.router.add_get("/v1/small/{dataset}", h.small)
    app.router.add_get("/v1/manifest/{dataset}", h.manifest)
    app.router.add_post("/v1/manifest/{dataset}", h.pushed_manifest)
    app.router.add_post("/v1/evict/{dataset}", h.evict)
    app.router.add_get("/v1/info", h.info)
    if replicas is not None:  # (their bodies are streamed to disk by their handler, checked and bounded)
        ReplicaHandlers(replicas).routes(app)
    app.router.add_get("/healthz", h.healthz)
    app.router.add_get("/readyz", h.readyz)
    return app

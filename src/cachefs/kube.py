"""A small Kubernetes API client (aiohttp): what the node agent, the label publisher and the extender need —
GET, PATCH, POST, list and watch — authenticated the two ways a node agent or scheduler component runs:
in-cluster (the pod's service-account token, re-read as kubelet rotates it, and the cluster CA) or from a
kubeconfig (token or client certificate, CA file or inline data). Why not kubernetes-asyncio: docs/CLUSTER.md.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import json
import logging
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from cachefs.base.errors import ConfigError

__all__ = ["ApiError", "KubeClient", "KubeConfig", "Reflector", "load_kube_config"]

log = logging.getLogger(__name__)

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ApiError(Exception):
    """A non-2xx answer from the API server (``status`` is the HTTP code, ``reason`` the Status reason)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def retryable(self) -> bool:
        return self.status in (409, 429) or self.status >= 500


@dataclass(frozen=True)
class KubeConfig:
    server: str
    ca_file: str | None = None
    token: str | None = None
    token_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False


def _data_file(data_b64: str, suffix: str) -> str:
    """Inline kubeconfig data (``*-data`` fields) written to a private file, since ``ssl`` reads files."""
    fd, path = tempfile.mkstemp(prefix="cachefs-kube-", suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(data_b64))
    atexit.register(_remove, path)  # keys must not outlive the process
    return path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def load_kube_config(kubeconfig: str | None = None, *, env: Mapping[str, str] | None = None) -> KubeConfig:
    """In-cluster config when running in a pod (and no kubeconfig was named), else the kubeconfig's current
    context (``kubeconfig``, ``$KUBECONFIG`` or ``~/.kube/config``). Raises ConfigError when neither exists."""
    env = os.environ if env is None else env
    path = kubeconfig or env.get("KUBECONFIG")
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not path and host and os.path.exists(f"{SA_DIR}/token"):
        host = f"[{host}]" if ":" in host else host
        return KubeConfig(f"https://{host}:{port}", ca_file=f"{SA_DIR}/ca.crt", token_file=f"{SA_DIR}/token")
    path = path or os.path.expanduser("~/.kube/config")
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"no Kubernetes API access: not in a pod and cannot read kubeconfig {path}: "
                          f"{exc.strerror}") from None
    except yaml.YAMLError:
        raise ConfigError(f"kubeconfig {path}: not valid YAML") from None
    try:
        ctx_name = doc["current-context"]
        ctx = next(c["context"] for c in doc["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
        user: dict[str, Any] = next((u["user"] for u in doc.get("users") or [] if u["name"] == ctx.get("user")),
                                    {}) or {}
        server = cluster["server"]
    except (KeyError, StopIteration, TypeError):
        raise ConfigError(f"kubeconfig {path}: no usable current-context (cluster, server, user)") from None
    base = os.path.dirname(os.path.abspath(path))

    def rel(p: str | None) -> str | None:
        return os.path.join(base, p) if p else None

    ca = rel(cluster.get("certificate-authority"))
    if cluster.get("certificate-authority-data"):
        ca = _data_file(cluster["certificate-authority-data"], ".crt")
    cert, key = rel(user.get("client-certificate")), rel(user.get("client-key"))
    if user.get("client-certificate-data"):
        cert = _data_file(user["client-certificate-data"], ".crt")
    if user.get("client-key-data"):
        key = _data_file(user["client-key-data"], ".key")
    return KubeConfig(server.rstrip("/"), ca_file=ca, token=user.get("token"), token_file=rel(user.get("tokenFile")),
                      cert_file=cert, key_file=key, insecure=bool(cluster.get("insecure-skip-tls-verify")))


class KubeClient:
    """One aiohttp session to one API server. Paths are API paths (``/api/v1/nodes/x``)."""

    #: Seconds a token read from a file is trusted before re-reading it (kubelet rotates projected tokens).
    TOKEN_REFRESH = 60.0

    def __init__(self, config: KubeConfig, *, timeout: float = 30.0) -> None:
        self.config = config
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._token: tuple[float, str | None] = (0.0, config.token)

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.config.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.config.ca_file)
        if self.config.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.config.cert_file:
            ctx.load_cert_chain(self.config.cert_file, self.config.key_file)
        return ctx

    def _session_get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            try:
                connector = aiohttp.TCPConnector(ssl=self._ssl(), limit=32)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"Kubernetes API TLS setup failed: {exc}") from None
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        h = {"Accept": "application/json", "User-Agent": "cachefs"}
        if self.config.token_file and time.monotonic() - self._token[0] > self.TOKEN_REFRESH:
            try:
                with open(self.config.token_file) as f:
                    self._token = (time.monotonic(), f.read().strip())
            except OSError as exc:
                raise ConfigError(f"cannot read service-account token {self.config.token_file}: {exc.strerror}") from None
        if self._token[1]:
            h["Authorization"] = f"Bearer {self._token[1]}"
        if content_type:
            h["Content-Type"] = content_type
        return h

    async def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                      params: Mapping[str, str] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        try:
            async with self._session_get().request(
                    method, self.config.server + path, data=data, params=params,
                    headers=self._headers(content_type if data is not None else None),
                    timeout=aiohttp.ClientTimeout(total=self._timeout)) as resp:
                raw = await resp.read()
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"Kubernetes API {self.config.server}: {exc}") from None
        if resp.status >= 300:
            raise _api_error(resp.status, raw)
        return json.loads(raw) if raw else None

    async def get(self, path: str, **params: str) -> Any:
        return await self.request("GET", path, params=params or None)

    async def post(self, path: str, body: Any) -> Any:
        return await self.request("POST", path, body)

    async def merge_patch(self, path: str, patch: Any) -> Any:
        return await self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    async def watch(self, path: str, resource_version: str, *, timeout_s: int = 300,
                    params: Mapping[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type": ..., "object": ...}``) from ``resource_version``; ends when the server closes
        the stream (every ``timeout_s``). An ``ERROR`` event is raised as :class:`ApiError` (410 means relist).
        ``params``: more query parameters (a label selector)."""
        params = {**(params or {}), "watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(timeout_s)}
        try:
            async with self._session_get().get(
                    self.config.server + path, params=params, headers=self._headers(),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout,
                                                  sock_read=timeout_s + 30)) as resp:
                if resp.status >= 300:
                    raise _api_error(resp.status, await resp.read())
                async for line in resp.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        obj = event.get("object") or {}
                        raise ApiError(int(obj.get("code") or 500), str(obj.get("reason", "")),
                                       str(obj.get("message", "")))
                    yield event
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"Kubernetes API {self.config.server}: {exc}") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _api_error(status: int, raw: bytes) -> ApiError:
    try:
        doc = json.loads(raw)
        return ApiError(status, str(doc.get("reason", "")), str(doc.get("message", "")))
    except (ValueError, AttributeError):
        return ApiError(status, "", raw[:200].decode(errors="replace"))


Handler = Callable[[str, Mapping[str, Any]], None]

#: Seconds between looks for an optional API that is not served (a CRD installed after the watcher started).
OPTIONAL_RECHECK = 15.0


class Reflector:
    """Keeps ``handler(event_type, object)`` informed about every object at ``path``; ``handler("SYNC", {})``
    after each (re)list, once every listed object was delivered as ``ADDED``. Objects gone during a relist
    are delivered as ``DELETED``. The loop: list (remember ``resourceVersion``), watch from there, resume after
    a dropped stream from the last version seen, list again on 410 Gone or any other API error."""

    def __init__(self, client: KubeClient, path: str, handler: Handler, *, optional: bool = False,
                 params: Mapping[str, str] | None = None) -> None:
        """``params``: more query parameters for the list and the watch (a label selector)."""
        self.client, self.path, self.handler, self.optional = client, path, handler, optional
        self.params = dict(params or {})
        self.synced = asyncio.Event()
        self._known: dict[str, Mapping[str, Any]] = {}
        self._listed = False

    @staticmethod
    def _key(obj: Mapping[str, Any]) -> str:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace', '')}/{meta.get('name', '')}"

    async def _list(self) -> str:
        doc = await self.client.get(self.path, **self.params)
        if self.optional and not self._listed:
            log.info("watching %s", self.path)
        self._listed = True
        seen = {}
        for obj in doc.get("items") or []:
            seen[self._key(obj)] = obj
            self.handler("ADDED", obj)
        for key in set(self._known) - set(seen):
            self.handler("DELETED", self._known[key])
        self._known = seen
        self.handler("SYNC", {})
        self.synced.set()
        return str((doc.get("metadata") or {}).get("resourceVersion", ""))

    async def run(self) -> None:
        delay = 0.5
        rv = ""
        while True:
            try:
                if not rv:
                    rv = await self._list()
                async for event in self.client.watch(self.path, rv, params=self.params):
                    obj = event.get("object") or {}
                    rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                    if event["type"] == "BOOKMARK":
                        continue
                    if event["type"] == "DELETED":
                        self._known.pop(self._key(obj), None)
                    else:
                        self._known[self._key(obj)] = obj
                    self.handler(event["type"], obj)
                delay = 0.5
            except ApiError as exc:
                if exc.status == 410:
                    rv = ""
                    continue
                if exc.status in (403, 404) and self.optional:
                    # Not served (its CRD or API is not installed) or not allowed: nothing to wait for at start;
                    # looked for again now and then, so an API installed later is watched from then on.
                    if not self.synced.is_set():
                        log.info("%s: %s; not watching it until it is served", self.path,
                                 "not allowed" if exc.status == 403 else "not served")
                    self.synced.set()
                    rv = ""
                    await asyncio.sleep(OPTIONAL_RECHECK)
                    continue
                log.warning("watching %s: %s; relisting", self.path, exc)
                rv = ""
            except (TimeoutError, OSError, ValueError) as exc:
                log.warning("watching %s: %s; resuming", self.path, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

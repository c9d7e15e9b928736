"""The peer protocol's client: plain HTTP/1.1 keep-alive GETs to other members' peer servers.

Every answer carries the xxh3 the owner's index recorded for those bytes when they were first fetched
(``X-Cachefs-Xxh3``), not one computed over what it sends: a block that rotted on the owner's disk, or bytes
damaged on the way, fail the check here, are dropped and fetched elsewhere. Requests name an object by its
dataset id, path and version (the owner checks them against its manifests: a request can never name a file
outside its cache), and a block by its index.
"""

from __future__ import annotations

import json
import os
import time

import aiohttp

from cachefs.base.checksum import block_checksum, block_hasher
from cachefs.base.errors import CacheFSError
from cachefs.base.metrics import PEER_ERRORS, safely
from cachefs.cluster.auth import read_token
from cachefs.cluster.heat import HOT_HEADER
from cachefs.cluster.tls import GroupTLS

__all__ = ["CHECKSUM_HEADER", "MEMBER_HEADER", "PeerClient", "PeerError"]

CHECKSUM_HEADER = "X-Cachefs-Xxh3"
MEMBER_HEADER = "X-Cachefs-Member"
#: Seconds a manifest request may wait for its answer. The member that lists a dataset for the group answers once
#: its listing finished, which for millions of objects takes minutes; a reader that gave up sooner would list the
#: bucket itself, and so would every other. A member that is down is still skipped at once (refused, or the
#: connect timeout).
MANIFEST_WAIT = 900.0


class PeerError(CacheFSError):
    """A peer did not answer, refused, or answered wrongly (it is skipped; the next tier serves)."""


def _failed(reason: str, message: str) -> PeerError:
    """A PeerError, counted by its reason (``cachefs_peer_errors_total``): ``unreachable`` (refused, reset, timed
    out), ``http`` (an error status), ``bad_answer`` (too long, no checksum), ``corrupt`` (failed its checksum)."""
    safely(PEER_ERRORS.labels(reason).inc)
    return PeerError(message)


class PeerClient:
    """One connection pool to the group's peer servers, presenting this node's token."""

    def __init__(self, self_name: str, token_file: str | None, *, timeout: float = 10.0,
                 connections_per_peer: int = 8, tls: GroupTLS | None = None) -> None:
        self.self_name, self.token_file, self.timeout = self_name, token_file, timeout
        self.tls = tls
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._manifest_timeout = aiohttp.ClientTimeout(total=MANIFEST_WAIT, sock_connect=timeout)
        self._per_peer = connections_per_peer
        self._session: aiohttp.ClientSession | None = None
        self._retired: list[aiohttp.ClientSession] = []
        self._token: tuple[float, str] = (0.0, "")

    def identify_as(self, self_name: str, token_file: str | None, tls: GroupTLS | None = None) -> None:
        """Present another name, token or TLS certificate from now on (the agent's members file changed)."""
        if (self_name, token_file, tls) != (self.self_name, self.token_file, self.tls):
            self.self_name, self.token_file, self._token = self_name, token_file, (0.0, "")
            if tls != self.tls:
                self.tls = tls
                if self._session is not None:  # new connections with the new context; the old ones close at close()
                    self._retired.append(self._session)
                    self._session = None

    @property
    def _scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def _headers(self) -> dict[str, str]:
        h = {MEMBER_HEADER: self.self_name}
        if self.token_file:
            if time.monotonic() - self._token[0] > 60.0:  # kubelet rotates projected tokens
                self._token = (time.monotonic(), read_token(self.token_file))
            h["Authorization"] = f"Bearer {self._token[1]}"
        return h

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context = self.tls.client() if self.tls is not None else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit_per_host=self._per_peer, ssl=ssl_context if ssl_context else True),
                timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def _get(self, address: str, path: str, params: dict[str, str], limit: int, *,
                   timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, bytes, dict]:
        url = f"{self._scheme}://{address}{path}"
        try:
            async with self._client().get(url, params=params, headers=self._headers(),
                                          timeout=timeout or self._timeout) as resp:
                if resp.content_length is not None and resp.content_length > limit:
                    raise _failed("bad_answer", f"{address}: an answer of {resp.content_length} bytes, at most {limit} asked")
                # read(n) returns what has arrived so far, not n bytes: gather the body up to the limit + 1
                # (one byte more tells an over-long answer).
                parts, got = [], 0
                while got <= limit and (chunk := await resp.content.read(limit + 1 - got)):
                    parts.append(chunk)
                    got += len(chunk)
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                return resp.status, body, dict(resp.headers)
        except PeerError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _failed("unreachable", f"peer {address}: {type(exc).__name__}: {exc}") from None

    async def _verified(self, address: str, path: str, params: dict[str, str], limit: int, *,
                        length: int | None = None,
                        timeout: aiohttp.ClientTimeout | None = None) -> tuple[bytes | None, dict]:
        """The body of a GET, checked against the xxh3 the peer sends with it (and ``length``, when known), and the
        answer's headers; None for a 404 (the peer does not hold it and does not fetch it). ``timeout``: the
        client's otherwise."""
        status, body, headers = await self._get(address, path, params, limit, timeout=timeout)
        if status == 404:
            return None, headers
        if status != 200:
            raise _failed("http", f"peer {address}: HTTP {status} {body[:200].decode(errors='replace')}")
        if length is not None and len(body) != length:
            raise _failed("bad_answer", f"peer {address}: {len(body)} bytes, {length} expected")
        try:
            expected = int(headers.get(CHECKSUM_HEADER, ""), 16)
        except ValueError:
            raise _failed("bad_answer", f"peer {address}: no checksum with {path}") from None
        if block_checksum(body) != expected:
            raise _failed("corrupt", f"peer {address}: {path} failed its checksum")
        return body, headers

    @staticmethod
    def _hot(headers: dict) -> int:
        raw = headers.get(HOT_HEADER, "0")
        return int(raw) if raw.isdigit() and len(raw) < 3 else 0

    async def _file(self, address: str, kind: str, ds_id: str, params: dict[str, str], length: int, *,
                    fetch: bool, replica: bool) -> tuple[bytes | None, int]:
        params["fetch"] = "1" if fetch else "0"
        if replica:
            params["replica"] = "1"
        body, headers = await self._verified(address, f"/v1/{kind}/{ds_id}", params, length, length=length)
        return body, self._hot(headers)

    async def block(self, address: str, ds_id: str, url: str, path: str, version: str, idx: int,
                    length: int, *, fetch: bool = True, replica: bool = False) -> tuple[bytes | None, int]:
        """Block ``idx`` (``length`` bytes) of ``path`` at ``version`` of dataset ``ds_id`` (at ``url``), verified;
        None if the peer does not hold it and does not fetch it (``fetch`` False, or it is not an owner). With the
        replicas the peer says the block's directory has (0: it is not hot). ``replica``: the peer is asked as a
        replica of a hot key (it fetches from the owner, not the origin)."""
        return await self._file(address, "block", ds_id, {"url": url, "path": path, "version": version,
                                                          "block": str(idx)}, length, fetch=fetch, replica=replica)

    async def small(self, address: str, ds_id: str, url: str, path: str, version: str,
                    length: int, *, fetch: bool = True, replica: bool = False) -> tuple[bytes | None, int]:
        """The whole small file ``path`` at ``version``, verified, as :meth:`block`."""
        return await self._file(address, "small", ds_id, {"url": url, "path": path, "version": version}, length,
                                fetch=fetch, replica=replica)

    async def manifest(self, address: str, ds_id: str, *, url: str = "", limit: int = 1 << 30) -> bytes | None:
        """The current manifest of dataset ``ds_id`` (at ``url``) as the peer holds it, or takes it if it serves
        that dataset to the group (see peer_server), verified. Waits for the peer's listing (:data:`MANIFEST_WAIT`)."""
        return (await self._verified(address, f"/v1/manifest/{ds_id}", {"url": url} if url else {}, limit,
                                     timeout=self._manifest_timeout))[0]

    async def push_manifest(self, address: str, ds_id: str, url: str, raw: bytes) -> bool:
        """Hand a member the manifest this node just took of dataset ``ds_id`` (``cachefs refresh``); whether it
        took it (a member that does not know the dataset declines)."""
        try:
            async with self._client().post(f"{self._scheme}://{address}/v1/manifest/{ds_id}", params={"url": url}, data=raw,
                                           headers={**self._headers(),
                                                    CHECKSUM_HEADER: f"{block_checksum(raw):016x}"}) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _failed("unreachable", f"peer {address}: {type(exc).__name__}: {exc}") from None

    async def evict(self, address: str, ds_id: str, url: str) -> int | None:
        """Have a member drop what it caches of dataset ``ds_id`` (``cachefs evict --group``); the bytes it freed,
        or None when it does not know the dataset."""
        try:
            async with self._client().post(f"{self._scheme}://{address}/v1/evict/{ds_id}", params={"url": url},
                                           headers=self._headers()) as resp:
                body = await resp.read()
                if resp.status == 404:
                    return None
                if resp.status != 200:
                    raise _failed("http", f"peer {address}: HTTP {resp.status} {body[:200].decode(errors='replace')}")
                freed = json.loads(body).get("freed")
                if not isinstance(freed, int):
                    raise _failed("bad_answer", f"peer {address}: an eviction answer without the bytes freed")
                return freed
        except PeerError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError) as exc:
            raise _failed("unreachable", f"peer {address}: {type(exc).__name__}: {exc}") from None

    # -- checkpoint replicas (cachefs.agent.replicas) ---------------------------------------------------------------
    async def _call(self, method: str, address: str, path: str, *, params: dict | None = None, data=None,
                    headers: dict | None = None, timeout: float | None = None) -> tuple[int, bytes]:
        try:
            async with self._client().request(
                    method, f"{self._scheme}://{address}{path}", params=params, data=data,
                    headers={**self._headers(), **(headers or {})},
                    timeout=aiohttp.ClientTimeout(total=timeout or self.timeout)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _failed("unreachable", f"peer {address}: {type(exc).__name__}: {exc}") from None

    async def put_replica(self, address: str, volume: str, entry: int, url: str, key: str, path: str,
                          size: int, checksum: int) -> None:
        """Have a member hold a copy of a closed checkpoint file (``path``, ``size`` bytes) until its upload."""
        with open(path, "rb") as f:
            status, body = await self._call(
                "PUT", address, f"/v1/replica/{volume}/{entry}", params={"url": url, "key": key}, data=f,
                headers={CHECKSUM_HEADER: f"{checksum:016x}", "Content-Length": str(size)},
                timeout=self.timeout + size / (50 << 20))  # (a slow link is not a hung peer)
        if status != 200:
            raise _failed("http", f"peer {address}: HTTP {status} {body[:200].decode(errors='replace')}")

    async def replicas(self, address: str, volume: str) -> list[dict]:
        """The copies of a volume's files a member holds: ``[{"entry", "key", "size", "writer"}]``."""
        status, body = await self._call("GET", address, f"/v1/replicas/{volume}")
        if status != 200:
            raise _failed("http", f"peer {address}: HTTP {status}")
        try:
            out = json.loads(body)
            return [r for r in out if isinstance(r, dict) and {"entry", "key", "size"} <= r.keys()]
        except (ValueError, TypeError):
            raise _failed("bad_answer", f"peer {address}: not a replica listing") from None

    async def get_replica(self, address: str, volume: str, entry: str, fd: int, size: int) -> None:
        """Write the copy a member holds into ``fd`` (from offset 0), checked against its xxh3 and ``size``."""
        url = f"{self._scheme}://{address}/v1/replica/{volume}/{entry}"
        hasher, got = block_hasher(), 0
        try:
            async with self._client().get(url, headers=self._headers(), timeout=aiohttp.ClientTimeout(
                    total=self.timeout + size / (50 << 20))) as resp:
                if resp.status != 200:
                    raise _failed("http", f"peer {address}: HTTP {resp.status}")
                expected = int(resp.headers.get(CHECKSUM_HEADER, "x"), 16)
                async for chunk in resp.content.iter_chunked(1 << 20):
                    hasher.update(chunk)
                    os.pwrite(fd, chunk, got)
                    got += len(chunk)
        except PeerError:
            raise
        except ValueError:
            raise _failed("bad_answer", f"peer {address}: no checksum with the replica") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _failed("unreachable", f"peer {address}: {type(exc).__name__}: {exc}") from None
        if got != size or hasher.intdigest() != expected:
            raise _failed("corrupt", f"peer {address}: the replica of entry {entry} failed its length or checksum")

    async def drop_replica(self, address: str, volume: str, entry: int) -> None:
        await self._call("DELETE", address, f"/v1/replica/{volume}/{entry}")

    async def rekey_replica(self, address: str, volume: str, entry: int, key: str) -> None:
        await self._call("POST", address, f"/v1/replica/{volume}/{entry}", params={"key": key})

    async def close(self) -> None:
        for session in [*self._retired, self._session]:
            if session is not None:
                await session.close()
        self._retired.clear()

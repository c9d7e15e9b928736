"""Ranged GetObject and ListObjectsV2 requests signed by us (AWS Signature Version 4): GETs sent by our own
HTTP/1.1 client (:mod:`.http1`, bodies received straight into their buffer), listing pages on an aiohttp
session (S3 sends them chunked).

Why: through aiobotocore a small GET cost ~0.85 ms of client CPU here (event hooks, the user-agent string,
request serialisation, response parsing), four times the request itself; prefetching 20,000 small files was
bound by it. A GET needs none of that machinery: a URL, three signed headers and a status code. A listing page
through botocore cost ~70 µs of CPU per object (its XML parser builds every field through the service model),
so taking the manifest of a million-object dataset was a minute of one core before any request waited.

What stays botocore's: where a bucket lives (endpoint, virtual-host or path style, region) is read once per
bucket from the first GetObject (ListObjectsV2) that botocore sends to it; credentials are the client's own,
refreshed by botocore; and every response that is not a success, or a listing this module cannot read, is sent
again through botocore, so errors are parsed and classified in one place. Anything this module does not
understand (another signature version) leaves the bucket on botocore.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote_plus, urlsplit
from xml.etree import ElementTree

from cachefs.sources.http1 import Http1Pool, UnsupportedResponse

__all__ = ["BucketRoute", "SignedGet", "list_query", "parse_list_page", "route_from_list_request",
           "route_from_request", "sigv4_headers"]

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_ERROR_BODY_MAX = 1 << 20  # the longest error document a GET takes in (a longer answer goes to botocore)
_CREDENTIAL = re.compile(r"AWS4-HMAC-SHA256 Credential=[^/]+/\d{8}/([^/]+)/s3/aws4_request[,\s]")


@dataclass(frozen=True)
class BucketRoute:
    """Where GETs for one bucket go: ``prefix + quoted key`` on ``host``, signed for ``region`` (None: unsigned)."""

    prefix: str
    host: str
    path_prefix: str
    region: str | None


def route_from_request(url: str, authorization: str, key: str) -> BucketRoute | None:
    """The route of a bucket, from a GetObject of ``key`` as botocore sent it (its URL and Authorization
    header); None when the request was signed some other way than SigV4 or the URL is not prefix + key."""
    base = url.partition("?")[0]
    quoted = quote(key, safe="/~")
    if not base.endswith("/" + quoted):
        return None
    return _route(base[: -len(quoted)], authorization)


def route_from_list_request(url: str, authorization: str, bucket: str) -> BucketRoute | None:
    """The listing route of ``bucket``, from a ListObjectsV2 as botocore sent it: ``prefix`` is the URL the
    query string goes after (``http://host/bucket`` path-style, ``https://bucket.host/`` virtual-host). None when
    it was signed some other way than SigV4 or the URL names the bucket neither way."""
    return _route(url.partition("?")[0], authorization) if _lists_bucket(url, bucket) else None


def _lists_bucket(url: str, bucket: str) -> bool:
    """Whether ``url`` is a listing of ``bucket`` (path-style or virtual-host)."""
    parts = urlsplit(url.partition("?")[0])
    return parts.path.strip("/") == quote(bucket, safe="~") or (parts.path == "/" and
                                                                parts.netloc.startswith(bucket + "."))


def _route(prefix: str, authorization: str) -> BucketRoute | None:
    """The route at URL ``prefix`` signed for the region in ``authorization`` ("": unsigned); None for a
    signature other than SigV4 for S3."""
    region = None
    if authorization:
        m = _CREDENTIAL.match(authorization)
        if m is None:
            return None
        region = m.group(1)
    parts = urlsplit(prefix)
    return BucketRoute(prefix=prefix, host=parts.netloc, path_prefix=parts.path, region=region)


def list_query(prefix: str, delimiter: str = "", token: str | None = None) -> str:
    """The ListObjectsV2 query string, in SigV4's canonical form (so it is signed exactly as sent); keys come
    back URL-encoded, as botocore asks for them (a key may hold characters XML 1.0 cannot)."""
    params = {"list-type": "2", "encoding-type": "url", "prefix": prefix}
    if delimiter:
        params["delimiter"] = delimiter
    if token:
        params["continuation-token"] = token
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))


def parse_list_page(body: bytes, parse_time: Callable[[str], Any]) -> dict | None:
    """A ListObjectsV2 response as botocore's client returns it (``Contents`` with Key, Size, ETag and
    LastModified through ``parse_time``, ``CommonPrefixes``, ``IsTruncated``, ``NextContinuationToken``); None
    for anything else (then botocore sends the request and reads the answer)."""
    try:
        root = ElementTree.fromstring(body)
    except (ElementTree.ParseError, LookupError, ValueError):  # LookupError: an encoding Python does not know
        return None
    ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    if root.tag != ns + "ListBucketResult":
        return None
    tags = {name: ns + name for name in ("Key", "Size", "ETag", "LastModified", "Prefix", "Contents",
                                         "CommonPrefixes", "IsTruncated", "NextContinuationToken", "EncodingType")}
    decode = unquote_plus if root.findtext(tags["EncodingType"]) == "url" else str
    key_tag, size_tag, etag_tag, time_tag = tags["Key"], tags["Size"], tags["ETag"], tags["LastModified"]
    contents = []
    try:
        for obj in root.iterfind(tags["Contents"]):
            fields = {el.tag: el.text or "" for el in obj}
            contents.append({"Key": decode(fields[key_tag]), "Size": int(fields[size_tag]),
                             "ETag": fields.get(etag_tag), "LastModified": parse_time(fields[time_tag])})
        prefixes = []
        for p in root.iterfind(tags["CommonPrefixes"]):
            text = p.findtext(tags["Prefix"])
            if text is None:  # a CommonPrefixes without Prefix: not a page read here
                return None
            prefixes.append({"Prefix": decode(text)})
    except (KeyError, TypeError, ValueError):
        return None
    page: dict = {"Contents": contents, "CommonPrefixes": prefixes,
                  "IsTruncated": root.findtext(tags["IsTruncated"]) == "true"}
    token = root.findtext(tags["NextContinuationToken"])
    if token:
        page["NextContinuationToken"] = token
    elif page["IsTruncated"]:
        return None  # truncated without a way on
    return page


def sigv4_headers(
    *, host: str, path: str, region: str, access_key: str, secret_key: str, token: str | None,
    now: float | None = None, keys: dict | None = None, query: str = "",
) -> dict[str, str]:
    """The headers that sign ``GET path?query`` on ``host`` for S3 (SigV4, empty payload).

    ``path`` is the URL path exactly as sent (already percent-encoded), ``query`` the query string in
    canonical form (sorted, encoded: see :func:`list_query`). ``keys`` caches derived signing keys (one HMAC
    chain per secret, day and region instead of one per request).
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    day = stamp[:8]
    headers = {"host": host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": stamp}
    if token:
        headers["x-amz-security-token"] = token
    names = sorted(headers)
    signed = ";".join(names)
    canonical = "\n".join(["GET", path, query, *(f"{n}:{headers[n]}" for n in names), "", signed, _EMPTY_SHA256])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    cache_key = (secret_key, day, region)
    key = keys.get(cache_key) if keys is not None else None
    if key is None:
        key = f"AWS4{secret_key}".encode()
        for part in (day, region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        if keys is not None:
            if len(keys) > 16:
                keys.clear()
            keys[cache_key] = key
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, "
                                f"Signature={signature}")
    return headers


class SignedGet:
    """Ranged GETs and listing pages of S3 buckets outside botocore, once botocore has sent one of each to the
    bucket (its route).

    ``get`` and ``list`` return None when botocore should send the request: route not learned yet, or not a
    success. Call :meth:`learn` (:meth:`learn_list`) after botocore's GET (listing) succeeded.
    """

    def __init__(self, client: Any, pool: int, connect_timeout: float, parse_time: Callable[[str], Any]) -> None:
        self._client = client
        self._pool = pool
        self._connect_timeout = connect_timeout
        self._parse_time = parse_time
        self._routes: dict[str, BucketRoute | None] = {}
        self._list_routes: dict[str, BucketRoute | None] = {}
        self._sent: dict[str, str] = {}  # URL -> Authorization of GETs botocore sent, until their bucket's route is known
        self._sent_lists: dict[str, str] = {}  # the same for listings (URL without its query)
        self._keys: dict = {}
        self._session: Any = None  # aiohttp, for listing pages
        self._gets: Http1Pool | None = None  # for GETs
        self._url: Any = None  # yarl.URL, imported with aiohttp on the first listing
        client.meta.events.register("before-send.s3.GetObject", self._observe)
        client.meta.events.register("before-send.s3.ListObjectsV2", self._observe_list)

    def _observe(self, request, **_) -> None:
        _remember(self._sent, request)

    def _observe_list(self, request, **_) -> None:
        _remember(self._sent_lists, request)

    def learn(self, bucket: str, key: str) -> None:
        """Take the bucket's route from botocore's GET of ``key`` that just succeeded."""
        quoted = "/" + quote(key, safe="/~")
        _take_route(self._sent, self._routes, bucket, lambda url: url.endswith(quoted),
                    lambda url, auth: route_from_request(url, auth, key))

    def learn_list(self, bucket: str) -> None:
        """Take the bucket's listing route from botocore's ListObjectsV2 that just succeeded."""
        _take_route(self._sent_lists, self._list_routes, bucket, lambda url: _lists_bucket(url, bucket),
                    lambda url, auth: route_from_list_request(url, auth, bucket))

    async def list(self, bucket: str, prefix: str, delimiter: str = "", token: str | None = None) -> dict | None:
        """One ListObjectsV2 page (see :func:`parse_list_page`); None when botocore should send it."""
        route = self._list_routes.get(bucket)
        if route is None:
            return None
        query = list_query(prefix, delimiter, token)
        headers: dict[str, str] = {}
        if not await self._sign(route, route.path_prefix, query, headers):
            return None
        async with self._http().get(self._url(f"{route.prefix}?{query}", encoded=True), headers=headers) as resp:
            body = await resp.read()
            return parse_list_page(body, self._parse_time) if resp.status == 200 else None

    async def _sign(self, route: BucketRoute, path: str, query: str, headers: dict[str, str]) -> bool:
        """Add the SigV4 headers for ``path?query`` to ``headers`` (nothing for an unsigned route); False when
        there are no credentials to sign with."""
        if route.region is None:
            return True
        creds = await self._credentials()
        if creds is None:
            return False
        headers.update(sigv4_headers(host=route.host, path=path, region=route.region, access_key=creds.access_key,
                                     secret_key=creds.secret_key, token=creds.token, keys=self._keys, query=query))
        return True

    async def _credentials(self):
        creds = getattr(getattr(self._client, "_request_signer", None), "_credentials", None)
        if creds is None:
            return None
        frozen = creds.get_frozen_credentials()
        return await frozen if asyncio.iscoroutine(frozen) else frozen

    def _http(self):
        if self._session is None:
            import aiohttp
            from yarl import URL

            self._url = URL
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._pool, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(sock_connect=self._connect_timeout),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def get(self, bucket: str, key: str, range_header: str, if_match: str | None, length: int
                  ) -> bytearray | None:
        """The body of a successful ranged GET of ``length`` bytes, received straight into a bytearray
        (:mod:`.http1`); None when botocore should send it (also for a response that client does not read)."""
        route = self._routes.get(bucket)
        if route is None:
            return None
        headers = {"Range": range_header}
        if if_match:
            headers["If-Match"] = if_match
        path = route.path_prefix + quote(key, safe="/~")
        if not await self._sign(route, path, "", headers):
            return None
        if self._gets is None:
            self._gets = Http1Pool(self._pool, self._connect_timeout)
        try:
            resp = await self._gets.get(route.prefix + path[len(route.path_prefix):], headers,
                                        max(length, _ERROR_BODY_MAX))
        except UnsupportedResponse:
            return None
        return resp.body if resp.status in (200, 206) else None

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        gets, self._gets = self._gets, None
        if gets is not None:
            await gets.close()


def _take_route(sent: dict[str, str], routes: dict[str, BucketRoute | None], bucket: str,
                matches: Callable[[str], bool], route_of: Callable[[str, str], BucketRoute | None]) -> None:
    """Record ``bucket``'s route from the request in ``sent`` that ``matches``: None (botocore keeps the bucket)
    when it was signed some way we do not sign. Once per bucket."""
    if bucket in routes:
        return
    for url, auth in list(sent.items()):
        if matches(url):
            routes[bucket] = route_of(url, auth)
            sent.pop(url, None)
            return


def _remember(sent: dict[str, str], request) -> None:
    """Note the URL and Authorization header of a request botocore is sending (a bounded few)."""
    if len(sent) >= 256:
        sent.clear()
    auth = request.headers.get("Authorization", b"")
    sent[request.url.partition("?")[0]] = auth.decode() if isinstance(auth, bytes) else str(auth)

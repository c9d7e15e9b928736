"""The S3 origin: parallel listing with ListObjectsV2 and ranged GETs pinned to an ETag with ``If-Match``.

s3fs is used only to build the aiobotocore client, so endpoint and credentials resolve exactly as boto3 and
the aws CLI resolve them (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, ``AWS_REGION``, instance roles); explicit config and fsspec ``s3={...}`` options win.
Retries are ours (botocore's are switched off) so there is one backoff policy and one error table.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from cachefs.base.config import EngineConfig, OriginConfig
from cachefs.base.errors import ConfigError, InvalidURLError, ObjectNotFoundError, OriginError
from cachefs.base.types import Entry
from cachefs.sources.base import RetryPolicy, Source, with_retries
from cachefs.sources.installed import s3fs_fsspec_mismatch
from cachefs.sources.s3_get import SignedGet

__all__ = ["S3Source"]

#: Below this depth prefixes are listed with a delimiter (so they fan out in parallel); deeper, flat.
_FANOUT_DEPTH = 2


def _split(url: str) -> tuple[str, str]:
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise InvalidURLError(f"{url!r}: no bucket name")
    return bucket, key


def parse_timestamp(value: str) -> datetime:
    """An S3 timestamp (ISO 8601 in listings, RFC 1123 in headers) as an aware datetime, for botocore's parsers.
    Their default goes through dateutil, which was a quarter of the CPU time of listing 20,000 objects."""
    try:
        parsed = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            parsed = _general_timestamp(value)
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _general_timestamp(value: str) -> datetime:
    """botocore's general parser, for the rare other forms. A time zone dateutil does not know makes it warn
    and guess; that is refused like any unreadable timestamp (ValueError), not guessed."""
    import warnings

    from botocore.utils import parse_timestamp as slow_but_general

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return slow_but_general(value)
    except Warning as exc:
        raise ValueError(f"unreadable timestamp {value[:64]!r}: {exc}") from None


def _etag(raw: str | None) -> str:
    return (raw or "").strip('"')


class S3Source(Source):
    verifies_version = True

    def __init__(
        self,
        origin: OriginConfig,
        engine: EngineConfig | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._origin = origin
        self._pool = (engine or EngineConfig()).max_concurrent_fetches + origin.list_concurrency + 4
        self._options = dict(storage_options or {})
        self._policy = RetryPolicy(origin.max_attempts, origin.backoff_base, origin.backoff_max)
        self._fs = None
        self._client: Any = None
        self._client_lock = asyncio.Lock()
        self._direct: SignedGet | None = None

    async def connect(self) -> None:
        await self._s3()

    async def client(self) -> Any:
        """The aiobotocore S3 client (built on first use), for the writes of :mod:`cachefs.sources.writes`."""
        return await self._s3()

    async def _s3(self):
        if self._client is not None:
            return self._client
        async with self._client_lock:
            if self._client is None:
                mismatch = s3fs_fsspec_mismatch()
                if mismatch:
                    raise ConfigError(mismatch)
                import s3fs

                o = self._origin
                kw: dict[str, Any] = {
                    "asynchronous": True,
                    "skip_instance_cache": True,
                    "use_listings_cache": False,
                    "anon": o.anonymous,
                    "config_kwargs": {
                        "retries": {"max_attempts": 1, "mode": "standard"},
                        "connect_timeout": o.connect_timeout,
                        "read_timeout": o.request_timeout,
                        "max_pool_connections": self._pool,
                    },
                }
                if o.endpoint_url:
                    kw["endpoint_url"] = o.endpoint_url
                if o.access_key_id:
                    kw.update(key=o.access_key_id, secret=o.secret_access_key, token=o.session_token)
                if o.profile:
                    kw["profile"] = o.profile
                if o.region:
                    kw["client_kwargs"] = {"region_name": o.region}
                user = dict(self._options)
                for nested in ("config_kwargs", "client_kwargs"):
                    if nested in user:
                        kw[nested] = {**kw.get(nested, {}), **user.pop(nested)}
                kw.update(user)
                fs: Any = s3fs.S3FileSystem(**kw)  # (set_session returns the client; fsspec's base says None)
                if fs.session is None:  # the session s3fs would make, with our timestamp parser
                    from aiobotocore.session import AioSession

                    fs.session = AioSession(**fs.kwargs)
                    fs.session.get_component("response_parser_factory").set_parser_defaults(
                        timestamp_parser=parse_timestamp)
                self._client = await with_retries(fs.set_session, what="connect to S3", policy=self._policy,
                                                  kind="connect")
                self._fs = fs
                if o.direct_get:
                    self._direct = SignedGet(self._client, self._pool, o.connect_timeout, parse_timestamp)
        return self._client

    async def list_tree(self, root_url: str) -> AsyncIterator[list[Entry]]:
        bucket, key = _split(root_url)
        client = await self._s3()
        prefix = key + "/" if key else ""
        queue: asyncio.Queue = asyncio.Queue(maxsize=64)
        sem = asyncio.Semaphore(self._origin.list_concurrency)
        found_any = False

        async def list_prefix(pfx: str, depth: int) -> None:
            delimiter = "/" if depth < _FANOUT_DEPTH else ""
            children: list[str] = []
            token = None
            async with sem:
                while True:
                    page = await with_retries(
                        functools.partial(self._list_page, client, bucket, pfx, delimiter, token),
                        what=f"list s3://{bucket}/{pfx}",
                        policy=self._policy,
                        timeout=self._origin.request_timeout,
                        kind="list",
                    )
                    batch = [
                        Entry(
                            path=obj["Key"][len(prefix):],
                            size=int(obj["Size"]),
                            version=_etag(obj.get("ETag")),
                            mtime=obj["LastModified"].timestamp(),
                        )
                        for obj in page.get("Contents", ())
                    ]
                    children.extend(cp["Prefix"] for cp in page.get("CommonPrefixes", ()))
                    if batch:
                        await queue.put(batch)
                    if not page.get("IsTruncated"):
                        break
                    token = page.get("NextContinuationToken")
            # Directories need no entries of their own: the manifest derives them from the file paths.
            await asyncio.gather(*(list_prefix(c, depth + 1) for c in children))

        async def run() -> None:
            try:
                await list_prefix(prefix, 0)
            finally:
                await queue.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (batch := await queue.get()) is not None:
                found_any = True
                yield batch
            await task
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if not found_any:
            # An empty listing is either an empty prefix or a missing bucket; only the latter is an error.
            await with_retries(lambda: client.head_bucket(Bucket=bucket), what=f"s3://{bucket}",
                               policy=self._policy, timeout=self._origin.request_timeout, kind="head")

    lists_directories = True

    async def list_directory(self, root_url: str, path: str) -> AsyncIterator[tuple[list[Entry], list[str]]]:
        bucket, key = _split(root_url)
        client = await self._s3()
        base = key + "/" if key else ""
        prefix = base + (path + "/" if path else "")
        token, anything = None, False
        while True:
            page = await with_retries(functools.partial(self._list_page, client, bucket, prefix, "/", token),
                                      what=f"list s3://{bucket}/{prefix}", policy=self._policy,
                                      timeout=self._origin.request_timeout, kind="list")
            files = [Entry(path=obj["Key"][len(base):], size=int(obj["Size"]), version=_etag(obj.get("ETag")),
                           mtime=obj["LastModified"].timestamp())
                     for obj in page.get("Contents", ()) if obj["Key"] != prefix]
            dirs = [cp["Prefix"][len(prefix):].rstrip("/") for cp in page.get("CommonPrefixes", ())]
            if files or dirs:
                anything = True
                yield files, dirs
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        if not anything and not path:
            # An empty root is either an empty prefix or a missing bucket; only the latter is an error here.
            await with_retries(lambda: client.head_bucket(Bucket=bucket), what=f"s3://{bucket}",
                               policy=self._policy, timeout=self._origin.request_timeout, kind="head")

    async def _list_page(self, client, bucket: str, prefix: str, delimiter: str, token: str | None) -> dict:
        """One ListObjectsV2 page: signed and read by us once the bucket's listing route is known, else (and for
        any answer that is not a readable success) through botocore."""
        if self._direct is not None:
            page = await self._direct.list(bucket, prefix, delimiter, token)
            if page is not None:
                return page
        kw = {"Bucket": bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        if token:
            kw["ContinuationToken"] = token
        page = await client.list_objects_v2(**kw)
        if self._direct is not None:
            self._direct.learn_list(bucket)
        return page

    async def stat(self, url: str) -> Entry:
        bucket, key = _split(url)
        if not key:
            raise ObjectNotFoundError(f"{url}: not an object")
        client = await self._s3()
        head = await client.head_object(Bucket=bucket, Key=key)
        if "ContentLength" in head and "LastModified" in head:
            return Entry(url, int(head["ContentLength"]), _etag(head.get("ETag")), head["LastModified"].timestamp())
        # Some S3-compatible servers leave Content-Length (or Last-Modified) out of HEAD answers: the listing
        # has both.
        page = await client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
        for obj in page.get("Contents") or ():
            if obj.get("Key") == key and "Size" in obj:
                modified = obj.get("LastModified") or head.get("LastModified")
                return Entry(url, int(obj["Size"]), _etag(obj.get("ETag") or head.get("ETag")),
                             modified.timestamp() if modified is not None else 0.0)
        raise OriginError(f"{url}: the server answered HEAD without the object's size, and its listing has no such "
                          "object")

    async def read(self, url: str, version: str, start: int, end: int) -> bytes | bytearray:
        bucket, key = _split(url)
        client = await self._s3()
        kw = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
        if version:
            kw["IfMatch"] = f'"{version}"'
        if self._direct is not None:
            body = await self._direct.get(bucket, key, kw["Range"], kw.get("IfMatch"), end - start)
            if body is not None:
                return body
        # not signed by us, or not a success: botocore sends it (again) and raises its classified error
        resp = await client.get_object(**kw)
        async with resp["Body"] as body:
            data = await body.read()
        if self._direct is not None:
            self._direct.learn(bucket, key)
        return data

    async def write(self, url: str, data: bytes) -> Entry:
        bucket, key = _split(url)
        if not key:
            raise ObjectNotFoundError(f"{url}: not an object")
        client = await self._s3()
        resp = await client.put_object(Bucket=bucket, Key=key, Body=data)
        return Entry(url, len(data), _etag(resp.get("ETag")), 0.0)

    async def close(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            await direct.close()
        client, self._client = self._client, None
        if client is not None:
            await client.__aexit__(None, None, None)

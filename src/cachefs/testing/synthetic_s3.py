"""An S3 endpoint whose objects are computed, not stored: 10^7–10^8 objects cost no disk (bench/scale_bench.py).

Object ``i`` (0 ≤ i < N) of bucket ``synthetic`` is ``d{i // per_dir:06d}/f{i:010d}.bin`` (keys sort as the numbers
do); its size is 1–64 KiB, chosen from ``i``; its bytes are ``i`` and the offset, 8 bytes each, repeated
(:func:`content`, so a reader can check every byte it got); its ETag is computed from ``i``. ``--flat N`` adds one
directory ``flat/`` of N more objects numbered after the others.

Answers ListObjectsV2 and V1 (prefix, delimiter ``/``, continuation-token, start-after or marker, max-keys up to
1000), GetObject
(whole or one ``bytes=`` range), HeadObject and HeadBucket, unsigned (it checks no signature: loopback only). It
counts what it answered at ``GET /_synthetic/requests`` (listings also by the prefix's first directory); with
``--hold-prefix P`` listings under ``P`` wait until ``POST /_synthetic/release`` (a first listing held from
finishing, for tests).

    python -m cachefs.testing.synthetic_s3 --objects 10000000 --port 0   # prints PORT <n>
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import hashlib
import struct
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import quote

from aiohttp import web

__all__ = ["SyntheticBucket", "content", "main", "running"]

BUCKET = "synthetic"
_WORD = struct.Struct("<QQ")


def content(number: int, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of object ``number``: each 16-byte word is (number, word offset)."""
    first, last = start // 16, (end + 15) // 16
    raw = b"".join(_WORD.pack(number, w) for w in range(first, last))
    return raw[start - first * 16:end - first * 16]


class SyntheticBucket:
    """The keys and attributes of the objects, computed from their numbers."""

    def __init__(self, objects: int, per_dir: int = 1000, flat: int = 0) -> None:
        self.objects, self.per_dir, self.flat = objects, per_dir, flat
        self.dirs = -(-objects // per_dir)

    def key(self, i: int) -> str:
        if i >= self.objects:
            return f"flat/f{i:010d}.bin"
        return f"d{i // self.per_dir:06d}/f{i:010d}.bin"

    def number(self, key: str) -> int | None:
        """The object ``key`` names, or None."""
        name = key.partition("/")[2]
        if not (name.startswith("f") and name.endswith(".bin") and len(name) == 15 and name[1:11].isdigit()):
            return None
        i = int(name[1:11])
        if i >= self.objects + self.flat or self.key(i) != key:
            return None
        return i

    @staticmethod
    def size(i: int) -> int:
        return 1024 + (i * 2654435761) % (63 * 1024)

    @staticmethod
    def etag(i: int) -> str:
        return hashlib.md5(i.to_bytes(8, "little")).hexdigest()

    def _first_at_or_after(self, key: str) -> int:
        """The number of the first object whose key sorts at or after ``key``."""
        total = self.objects + self.flat
        return bisect.bisect_left(range(total), key, key=self.key)

    def list(self, prefix: str, delimiter: str, after: str, max_keys: int) -> tuple[list[int], list[str], str | None]:
        """(object numbers, common prefixes, the last key of this page when more follow) of one listing page."""
        contents: list[int] = []
        prefixes: list[str] = []
        if delimiter == "/" and prefix == "":
            tops = [f"d{d:06d}/" for d in range(self.dirs)] + (["flat/"] if self.flat else [])
            start = bisect.bisect_right(tops, after) if after else 0
            page = tops[start:start + max_keys]
            more = start + max_keys < len(tops)
            return [], page, page[-1] if more and page else None
        i = self._first_at_or_after(max(prefix, after + "\0") if after else prefix)
        total = self.objects + self.flat
        while i < total and len(contents) < max_keys:
            key = self.key(i)
            if not key.startswith(prefix):
                break
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:  # (only below a prefix that is not a directory: a partial name)
                common = prefix + rest.split(delimiter, 1)[0] + delimiter
                prefixes.append(common)
                i = self._first_at_or_after(common[:-1] + chr(ord(delimiter) + 1))
                continue
            contents.append(i)
            i += 1
        last = self.key(contents[-1]) if contents else (prefixes[-1] if prefixes else None)
        more = i < total and self.key(i).startswith(prefix)
        return contents, prefixes, last if more else None


def _listing_xml(bucket: SyntheticBucket, prefix: str, delimiter: str, contents: list[int], prefixes: list[str],
                 next_token: str | None, max_keys: int, v2: bool) -> bytes:
    parts = ['<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
             f"<Name>{BUCKET}</Name><Prefix>{prefix}</Prefix><KeyCount>{len(contents) + len(prefixes)}</KeyCount>",
             f"<MaxKeys>{max_keys}</MaxKeys>"]
    if delimiter:
        parts.append(f"<Delimiter>{delimiter}</Delimiter>")
    parts.append(f"<IsTruncated>{'true' if next_token else 'false'}</IsTruncated>")
    if next_token:
        parts.append(f"<NextContinuationToken>{quote(next_token)}</NextContinuationToken>" if v2
                     else f"<NextMarker>{next_token}</NextMarker>")
    for i in contents:
        parts.append(f"<Contents><Key>{bucket.key(i)}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                     f"<ETag>&quot;{bucket.etag(i)}&quot;</ETag><Size>{bucket.size(i)}</Size>"
                     "<StorageClass>STANDARD</StorageClass></Contents>")
    for p in prefixes:
        parts.append(f"<CommonPrefixes><Prefix>{p}</Prefix></CommonPrefixes>")
    parts.append("</ListBucketResult>")
    return "".join(parts).encode()


def _error(status: int, code: str, message: str) -> web.Response:
    body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>'
    return web.Response(status=status, body=body.encode(), content_type="application/xml")


def make_app(bucket: SyntheticBucket, hold_prefix: str | None = None) -> web.Application:
    counts: dict = {"list": 0, "get": 0, "head": 0, "held": 0, "lists_under": {}}
    released = asyncio.Event()

    async def requests(request: web.Request) -> web.Response:
        return web.json_response(counts)

    async def release(request: web.Request) -> web.Response:
        released.set()
        return web.json_response(counts)

    async def on_bucket(request: web.Request) -> web.Response:
        if request.match_info["bucket"] != BUCKET:
            return _error(404, "NoSuchBucket", "The specified bucket does not exist")
        if request.method == "HEAD":
            return web.Response()
        q = request.query
        v2 = q.get("list-type") == "2"
        counts["list"] += 1
        prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
        top = prefix.split("/", 1)[0] if "/" in prefix else ""
        counts["lists_under"][top] = counts["lists_under"].get(top, 0) + 1
        if hold_prefix is not None and prefix.startswith(hold_prefix) and not released.is_set():
            counts["held"] += 1
            await released.wait()
        max_keys = max(1, min(1000, int(q.get("max-keys", "1000"))))
        after = (q.get("continuation-token") or q.get("start-after") or "") if v2 else q.get("marker", "")
        contents, prefixes, next_token = bucket.list(prefix, delimiter, after, max_keys)
        return web.Response(body=_listing_xml(bucket, prefix, delimiter, contents, prefixes, next_token, max_keys, v2),
                            content_type="application/xml")

    async def on_object(request: web.Request) -> web.Response:
        if request.match_info["bucket"] != BUCKET:
            return _error(404, "NoSuchBucket", "The specified bucket does not exist")
        i = bucket.number(request.match_info["key"])
        if i is None:
            return _error(404, "NoSuchKey", "The specified key does not exist.")
        size = bucket.size(i)
        headers = {"ETag": f'"{bucket.etag(i)}"', "Last-Modified": "Thu, 01 Jan 2026 00:00:00 GMT",
                   "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            counts["head"] += 1
            headers["Content-Length"] = str(size)
            return web.Response(headers=headers)
        counts["get"] += 1
        start, end, status = 0, size, 200
        rng = request.headers.get("Range")
        if rng:
            lo, _, hi = rng.removeprefix("bytes=").partition("-")
            start, end = int(lo), min(size, int(hi) + 1 if hi else size)
            if start >= size:
                return _error(416, "InvalidRange", "The requested range is not satisfiable")
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return web.Response(status=status, body=content(i, start, end), headers=headers)

    app = web.Application()
    app.router.add_get("/_synthetic/requests", requests)
    app.router.add_post("/_synthetic/release", release)
    app.router.add_route("*", "/{bucket}", on_bucket)
    app.router.add_route("*", "/{bucket}/", on_bucket)
    app.router.add_route("*", "/{bucket}/{key:.+}", on_object)
    return app


@contextlib.contextmanager
def running(*args: str) -> Iterator[str]:
    """This endpoint in a process of its own, started with ``args`` (``--objects N``, ``--flat N`` …): its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.testing.synthetic_s3", *args], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"the synthetic S3 endpoint did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, required=True)
    p.add_argument("--per-dir", type=int, default=1000)
    p.add_argument("--flat", type=int, default=0, help="objects in one more directory, flat/")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--hold-prefix", help="listings of keys under this prefix wait until POST /_synthetic/release "
                   "(a listing that cannot finish, for tests)")
    args = p.parse_args(argv)

    async def serve() -> None:
        app = make_app(SyntheticBucket(args.objects, args.per_dir, args.flat), args.hold_prefix)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"PORT {port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

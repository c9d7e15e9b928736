"""The test S3 server's WSGI layers around moto (:mod:`.s3server`): seeding a bucket from inside the server, S3's
atomic conditional writes, request counts, and (benchmarks) GETs and listings answered from moto's store."""

from __future__ import annotations

import time

__all__ = ["atomic_conditional_writes", "counting", "fast_get", "fast_list", "seeding"]


def seeding(inner):
    """WSGI middleware: ``POST /_cachefs/seed`` fills a bucket with empty objects from inside the server."""
    from urllib.parse import parse_qs

    def app(environ, start_response):
        if environ.get("PATH_INFO") != "/_cachefs/seed" or environ["REQUEST_METHOD"] != "POST":
            return inner(environ, start_response)
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        q = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        count, dirs, prefix = int(q["count"]), max(1, int(q.get("dirs", "1"))), q.get("prefix", "").strip("/")
        for i in range(count):
            backend.put_object(q["bucket"], f"{prefix}/d{i % dirs}/f{i:07d}".lstrip("/"), b"")
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [f"{count}\n".encode()]

    return app


def atomic_conditional_writes(inner):
    """WSGI middleware: conditional writes (a PUT or a multipart completion with ``If-None-Match`` or ``If-Match``,
    a copy with ``x-amz-copy-source-if-match``) run one at a time. S3 decides them atomically; moto checks the
    condition and then stores, so two request threads could both pass the check, and a test of a commit race
    would see a server S3 is not. The copy's condition, which moto ignores, is checked here."""
    import threading
    from urllib.parse import unquote

    lock = threading.Lock()
    headers = ("HTTP_IF_NONE_MATCH", "HTTP_IF_MATCH", "HTTP_X_AMZ_COPY_SOURCE_IF_MATCH")

    def error(start_response, status: str, code: str) -> list[bytes]:
        body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{code}</Message></Error>"
        start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body.encode()]

    def copy_source_fails(environ, start_response) -> list[bytes] | None:
        # moto ignores x-amz-copy-source-if-match (S3 answers 412 when the source's ETag differs)
        want = environ.get("HTTP_X_AMZ_COPY_SOURCE_IF_MATCH")
        source = environ.get("HTTP_X_AMZ_COPY_SOURCE")
        if not want or not source:
            return None
        bucket, _, key = unquote(source.split("?", 1)[0]).lstrip("/").partition("/")
        b = _find_bucket(bucket)
        if b is None:
            return None  # (versioned, or no such bucket: moto answers)
        found = b.keys.get(key)
        if found is None:
            return error(start_response, "404 Not Found", "NoSuchKey")
        if want.strip('"') != found.etag.strip('"'):
            return error(start_response, "412 Precondition Failed", "PreconditionFailed")
        return None

    def app(environ, start_response):
        if environ["REQUEST_METHOD"] not in ("PUT", "POST") or not any(h in environ for h in headers):
            return inner(environ, start_response)
        with lock:
            return copy_source_fails(environ, start_response) or list(inner(environ, start_response))

    return app


def counting(inner):
    """WSGI middleware: every object GET (path and Range) and every listing is counted; ``GET
    /_cachefs/requests`` answers the counts as JSON (``?reset=1`` also zeroes them), so that a test can tell
    how many requests a group of clients made."""
    import json
    import threading
    from urllib.parse import parse_qs, unquote

    lock = threading.Lock()
    counts: dict = {"gets": {}, "lists": 0, "heads": 0, "list_queries": []}

    def app(environ, start_response):
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        query = environ.get("QUERY_STRING", "")
        if path == "/_cachefs/requests":
            with lock:
                body = json.dumps(counts).encode()
                if parse_qs(query).get("reset"):
                    counts.update(gets={}, lists=0, heads=0, list_queries=[])
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if not path.startswith("/_cachefs/") and not path.startswith("/moto-api/"):
            q = parse_qs(query)
            with lock:
                if method == "GET" and ("list-type" in q or "prefix" in q or "delimiter" in q
                                        or path.strip("/").count("/") == 0):
                    counts["lists"] += 1
                    if len(counts["list_queries"]) < 1000:
                        counts["list_queries"].append(f"{path}?{query}")
                elif method == "GET":
                    key = f"{unquote(path)} {environ.get('HTTP_RANGE', '')}".rstrip()
                    counts["gets"][key] = counts["gets"].get(key, 0) + 1
                elif method == "HEAD":
                    counts["heads"] += 1
        return inner(environ, start_response)

    return app


def fast_get(inner):
    """WSGI middleware: GetObject (path-style, optional Range and If-Match) served from moto's store."""
    import re
    from urllib.parse import unquote

    range_re = re.compile(r"bytes=(\d+)-(\d*)$")

    def find_key(path: str):
        bucket, _, key = unquote(path).lstrip("/").partition("/")
        b = _find_bucket(bucket) if key else None
        return b.keys.get(key) if b is not None else None

    def app(environ, start_response):
        query = environ.get("QUERY_STRING", "")
        if environ["REQUEST_METHOD"] != "GET" or (query and query != "x-id=GetObject"):
            return inner(environ, start_response)
        key = find_key(environ.get("PATH_INFO", ""))
        if key is None:
            return inner(environ, start_response)
        if_match = environ.get("HTTP_IF_MATCH")
        if if_match and if_match.strip('"') != key.etag.strip('"'):
            return inner(environ, start_response)  # moto's own 412 response
        size = key.size
        start, end, status = 0, size - 1, "200 OK"
        rng = environ.get("HTTP_RANGE")
        if rng:
            m = range_re.match(rng.strip())
            if not m or int(m.group(1)) >= size:
                return inner(environ, start_response)
            start = int(m.group(1))
            end = min(size - 1, int(m.group(2))) if m.group(2) else size - 1
            status = "206 Partial Content"
        with key.lock:
            key._value_buffer.seek(start)
            body = key._value_buffer.read(end - start + 1)
        headers = [("Content-Type", "binary/octet-stream"), ("Content-Length", str(len(body))),
                   ("ETag", key.etag), ("Last-Modified", key.last_modified_RFC1123), ("Accept-Ranges", "bytes")]
        if rng:
            headers.append(("Content-Range", f"bytes {start}-{end}/{size}"))
        start_response(status, headers)
        return [body]

    return app


def _find_bucket(name: str):
    """moto's bucket ``name`` if it is not versioned (those stay on moto's own code), else None."""
    from moto.s3.models import s3_backends

    for account in list(s3_backends):
        for partition in list(s3_backends[account]):
            b = s3_backends[account][partition].buckets.get(name)
            if b is not None and not b.is_versioned:
                return b
    return None


def fast_list(inner):
    """WSGI middleware: ListObjectsV2 (path-style) from a sorted copy of the bucket's key names, so a page costs
    a bisect and the page itself. The copy is rebuilt when the key count changes or it is a second old."""
    import base64
    import bisect
    from urllib.parse import parse_qs, quote, unquote
    from xml.sax.saxutils import escape

    known = {"list-type", "prefix", "delimiter", "max-keys", "continuation-token", "start-after", "encoding-type"}
    sorted_keys: dict[str, tuple[float, int, list[str]]] = {}

    def names(bucket_name: str, bucket) -> list[str]:
        at, count, keys = sorted_keys.get(bucket_name, (0.0, -1, []))
        if count != len(bucket.keys) or time.monotonic() - at > 1.0:
            keys = sorted(bucket.keys.keys())
            sorted_keys[bucket_name] = (time.monotonic(), len(keys), keys)
        return keys

    def app(environ, start_response):
        q = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        path = unquote(environ.get("PATH_INFO", "")).strip("/")
        if (environ["REQUEST_METHOD"] != "GET" or q.get("list-type") != ["2"] or not set(q) <= known
                or "/" in path or not path or q.get("encoding-type", ["url"]) != ["url"]):
            return inner(environ, start_response)
        bucket = _find_bucket(path)
        if bucket is None:
            return inner(environ, start_response)
        arg = {k: v[0] for k, v in q.items()}
        prefix, delimiter, start_after = arg.get("prefix", ""), arg.get("delimiter", ""), arg.get("start-after", "")
        max_keys = int(arg.get("max-keys", "1000"))
        keys = names(path, bucket)
        if "continuation-token" in arg:
            i = bisect.bisect_left(keys, base64.urlsafe_b64decode(arg["continuation-token"]).decode())
        elif start_after and start_after >= prefix:
            i = bisect.bisect_right(keys, start_after)
        else:
            i = bisect.bisect_left(keys, prefix)
        enc = (lambda v: quote(v, safe="/")) if "encoding-type" in arg else escape
        contents: list[str] = []
        prefixes: list[str] = []
        truncated = False
        while i < len(keys) and keys[i].startswith(prefix):
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            name = keys[i]
            cut = name.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                common = name[: cut + len(delimiter)]
                prefixes.append(f"<CommonPrefixes><Prefix>{enc(common)}</Prefix></CommonPrefixes>")
                i = bisect.bisect_left(keys, common[:-1] + chr(ord(common[-1]) + 1))
                continue
            key = bucket.keys.get(name)
            if key is not None:
                contents.append(f"<Contents><Key>{enc(name)}</Key><LastModified>{key.last_modified_ISO8601}"
                                f"</LastModified><ETag>{escape(key.etag)}</ETag><Size>{key.size}</Size>"
                                f"<StorageClass>STANDARD</StorageClass></Contents>")
            i += 1
        parts = ['<?xml version="1.0" encoding="UTF-8"?>',
                 '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
                 f"<Name>{escape(path)}</Name><Prefix>{enc(prefix)}</Prefix>",
                 f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>",
                 f"<Delimiter>{enc(delimiter)}</Delimiter>" if delimiter else "",
                 f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>",
                 *contents, *prefixes,
                 "<EncodingType>url</EncodingType>" if "encoding-type" in arg else ""]
        if "continuation-token" in arg:
            parts.append(f"<ContinuationToken>{escape(arg['continuation-token'])}</ContinuationToken>")
        if truncated:
            token = base64.urlsafe_b64encode(keys[i].encode()).decode()
            parts.append(f"<NextContinuationToken>{token}</NextContinuationToken>")
        if start_after:
            parts.append(f"<StartAfter>{enc(start_after)}</StartAfter>")
        parts.append("</ListBucketResult>")
        body = "".join(parts).encode()
        start_response("200 OK", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]

    return app

"""A real S3-speaking server on loopback: moto's server app in its own process, on an ephemeral port.

It is served by waitress (HTTP/1.1 with keep-alive, a pool of request threads) rather than moto's default
werkzeug server, which closes the connection after every response: S3 keeps connections open, and with a
connect per request the server managed ~1,250 small GETs/s here against ~3,500 with keep-alive.

Run directly (``python -m cachefs.testing.s3server --delay-ms 10``) it prints ``PORT <n>`` once listening.
``--delay-ms`` adds a per-request delay inside the server, to stand in for object-storage latency (this
kernel has no netem). :class:`S3Server` starts and stops it from Python.

``--fast`` (benchmarks only) answers plain path-style GetObject requests (whole or ranged) and ListObjectsV2
requests straight from moto's object store: moto copies the *whole* object for every ranged GET and scans
every key of the bucket for every listing page (74 ms per page at 20,000 keys), which would make the server,
not the client under test, the bottleneck; real S3 serves a range in time proportional to the range and a page
in time proportional to the page. Everything else (HEAD, PUT, versioned buckets, ListObjects V1,
virtual-host-style requests) still goes to moto.

``POST /_cachefs/seed?bucket=B&prefix=P&count=N&dirs=D`` (tests only) puts N empty objects
``P/d<k>/f<i>`` spread over D directories straight into moto's store: a 100,000-object listing test would
otherwise spend minutes on PUTs (moto takes ~330 a second here). Listing them still goes through moto's S3 API.

The server runs in a separate process (not a thread of the test process) so that its request handling does
not compete with the code under test for the GIL.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request

__all__ = ["CREDENTIALS", "LoopbackS3", "S3Server", "main"]

#: What moto accepts (any key works); clients of the test server use these.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--fast", action="store_true")
    p.add_argument("--threads", type=int, default=256,
                   help="request threads; each sleeps --delay-ms, so this bounds requests in flight")
    args = p.parse_args(argv)

    from moto.server import DomainDispatcherApplication, create_backend_app
    from waitress.server import create_server

    app = _atomic_conditional_writes(_seeding(DomainDispatcherApplication(create_backend_app)))
    if args.fast:
        app = _fast_list(_fast_get(app))
    app = _counting(app)
    delay = args.delay_ms / 1000.0
    if delay > 0:
        inner = app

        def app(environ, start_response):
            time.sleep(delay)
            return inner(environ, start_response)

    # Buffers sized for object bodies: waitress spills a response over 1 MiB to a temporary file by default,
    # and reads request bodies 8 KiB at a time.
    server = create_server(app, host=args.host, port=args.port, threads=args.threads, connection_limit=4096,
                           backlog=4096, channel_timeout=300, ident="cachefs-test-s3", recv_bytes=256 << 10,
                           outbuf_overflow=256 << 20, inbuf_overflow=256 << 20)
    server.channel_class = _channel_class()
    print(f"PORT {server.effective_port}", flush=True)
    server.run()


def _channel_class():
    """waitress's connection, except that ``Expect: 100-continue`` on an empty body is ignored: waitress sends
    the interim 100 and then never the response (botocore sends that pair for an empty PutObject)."""
    from waitress.channel import HTTPChannel
    from waitress.parser import HTTPRequestParser

    class Parser(HTTPRequestParser):
        def parse_header(self, header_plus):
            super().parse_header(header_plus)
            if not self.chunked and self.content_length == 0:
                self.expect_continue = False

    class Channel(HTTPChannel):
        parser_class = Parser

    return Channel


def _seeding(inner):
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


def _atomic_conditional_writes(inner):
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


def _counting(inner):
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


def _fast_get(inner):
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


def _fast_list(inner):
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


class LoopbackS3:
    """What clients of a test S3 server on loopback need: its ``endpoint`` (set by the server) and
    :data:`CREDENTIALS`."""

    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """The environment that points the AWS chain (boto3, s3fs, the cachefs CLI) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def _end_process(self, timeout: float) -> None:
        """Terminate the server's process ``self.proc`` (killed if it is still there after ``timeout`` s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self):
        """A boto3 S3 client of this server (path-style addressing)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                            config=Config(max_pool_connections=64, s3={"addressing_style": "path"}))


class S3Server(LoopbackS3):
    """Start moto's S3 server in a child process; ``endpoint`` is its URL. Use as a context manager."""

    def __init__(self, host: str = "127.0.0.1", delay_ms: float = 0.0, netns: str | None = None,
                 fast: bool = False, auth_after: int | None = None) -> None:
        """``auth_after``: moto checks credentials (against users made through its IAM API) from that many
        requests on; the first ones set up users and data. Default: any credentials work."""
        self.host, self.delay_ms, self.netns, self.fast = host, delay_ms, netns, fast
        self.auth_after = auth_after
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> S3Server:
        cmd = [sys.executable, "-m", "cachefs.testing.s3server", "--host", self.host,
               "--delay-ms", str(self.delay_ms)] + (["--fast"] if self.fast else [])
        if self.netns:
            cmd = ["nsenter", f"--net=/run/netns/{self.netns}", "--", *cmd]  # (no mount namespace: netlab.py)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.auth_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self.auth_after)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"moto server did not start (said {line!r})")
        self.port = int(line.split()[1])
        return self

    def seed(self, bucket: str, prefix: str, count: int, dirs: int = 1) -> None:
        """Put ``count`` empty objects ``prefix/d<k>/f<i>`` (``dirs`` directories) into ``bucket``, in-process."""
        from urllib.parse import urlencode

        query = urlencode({"bucket": bucket, "prefix": prefix, "count": count, "dirs": dirs})
        req = urllib.request.Request(f"{self.endpoint}/_cachefs/seed?{query}", method="POST")
        with urllib.request.urlopen(req, timeout=600):
            pass

    def requests(self, *, reset: bool = False) -> dict:
        """What the server was asked since start (or the last reset): ``{"gets": {"/bucket/key bytes=a-b": n},
        "lists": n, "heads": n}``."""
        import json

        with urllib.request.urlopen(f"{self.endpoint}/_cachefs/requests{'?reset=1' if reset else ''}",
                                    timeout=30) as resp:
            return json.loads(resp.read())

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=30):
            pass

    def make_user(self, name: str) -> dict[str, str]:
        """An IAM user allowed everything on S3 (three requests); returns the environment of its credentials."""
        import json

        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_REGION"],
                           aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                           aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        iam.create_user(UserName=name)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": CREDENTIALS["AWS_REGION"],
                "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def stop(self) -> None:
        if self.proc is not None:
            self._end_process(10)
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    main()

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

    from cachefs.testing.s3_middleware import atomic_conditional_writes, counting, fast_get, fast_list, seeding

    app = atomic_conditional_writes(seeding(DomainDispatcherApplication(create_backend_app)))
    if args.fast:
        app = fast_list(fast_get(app))
    app = counting(app)
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

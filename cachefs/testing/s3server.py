"""A real S3-speaking server on loopback: moto's server app in its own process, on an ephemeral port.

Run directly (``python -m cachefs.testing.s3server --delay-ms 10``) it prints ``PORT <n>`` once listening.
``--delay-ms`` adds a per-request delay inside the server, to stand in for object-storage latency (this
kernel has no netem). :class:`S3Server` starts and stops it from Python.

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

__all__ = ["S3Server", "main"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay-ms", type=float, default=0.0)
    args = p.parse_args(argv)

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    delay = args.delay_ms / 1000.0
    if delay > 0:
        inner = app

        def app(environ, start_response):  # type: ignore[no-redef]
            time.sleep(delay)
            return inner(environ, start_response)

    server = make_server(args.host, args.port, app, threaded=True)
    print(f"PORT {server.server_port}", flush=True)
    server.serve_forever()


class S3Server:
    """Start moto's S3 server in a child process; ``endpoint`` is its URL. Use as a context manager."""

    def __init__(self, host: str = "127.0.0.1", delay_ms: float = 0.0, netns: str | None = None) -> None:
        self.host, self.delay_ms, self.netns = host, delay_ms, netns
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> S3Server:
        cmd = [sys.executable, "-m", "cachefs.testing.s3server", "--host", self.host,
               "--delay-ms", str(self.delay_ms)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"moto server did not start (said {line!r})")
        self.port = int(line.split()[1])
        return self

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=30):
            pass

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing",
                            config=Config(max_pool_connections=64))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    main()

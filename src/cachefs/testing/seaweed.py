"""A second real S3 server on loopback: SeaweedFS (``weed server -s3``), for the semantics that differ between
implementations (multipart uploads, conditional writes, listings, ranged and ``If-Match`` reads).

The ``weed`` binary is built from Go modules by ``tests/s3impl/seaweedfs/build.sh`` into ``.cache/``;
:func:`find_weed` finds it (or ``$CACHEFS_SEAWEEDFS_BIN``). :class:`SeaweedServer` runs master, volume server,
filer and S3 gateway in one process, every port on 127.0.0.1 chosen free, data in a temporary directory,
telemetry off, and one S3 identity (the same keys as the moto test server).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

from cachefs.testing.s3server import CREDENTIALS, LoopbackS3

__all__ = ["SeaweedServer", "find_weed"]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_weed() -> str | None:
    """The ``weed`` binary: ``$CACHEFS_SEAWEEDFS_BIN``, else the newest one build.sh left under ``.cache/``."""
    env = os.environ.get("CACHEFS_SEAWEEDFS_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = sorted(glob.glob(os.path.join(_REPO, ".cache", "seaweedfs", "*", "weed")), key=os.path.getmtime)
    return found[-1] if found else None


def _free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now, each with port+10000 free too (SeaweedFS derives gRPC ports that way where a
    flag is not given; every one is given here, but a stray default must not collide either)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


class SeaweedServer(LoopbackS3):
    """``weed server`` with its S3 gateway; ``endpoint`` is the S3 URL. Use as a context manager."""

    def __init__(self, weed: str, *, start_timeout: float = 120.0) -> None:
        self.weed, self.start_timeout = weed, start_timeout
        self.dir = ""
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SeaweedServer:
        self.dir = tempfile.mkdtemp(prefix="cachefs-seaweed-")
        data = os.path.join(self.dir, "data")
        os.makedirs(data)
        config = os.path.join(self.dir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "cachefs-tests", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                                       "credentials": [{"accessKey": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                                        "secretKey": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}]}]}, f)
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
        self.port = s3
        cmd = [self.weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.telemetry=false",
               "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
               f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
               "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
               f"-filer.localSocket={self.dir}/filer.sock",
               "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.localSocket={self.dir}/s3.sock"]
        self._log = open(os.path.join(self.dir, "weed.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.dir,
                                     start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until a bucket can be made and an object written and read (the volume server has registered)."""
        deadline = time.monotonic() + self.start_timeout
        client, last = None, ""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                client = client or self.client()
                client.create_bucket(Bucket="cachefs-ready")
                client.put_object(Bucket="cachefs-ready", Key="probe", Body=b"ok")
                if client.get_object(Bucket="cachefs-ready", Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # noqa: BLE001 - not up yet: any failure means try again
                last = str(exc)
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"weed server's S3 gateway did not answer in {self.start_timeout:.0f} s ({last})")

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.dir, "weed.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        self._end_process(30)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

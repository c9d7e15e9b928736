"""A checkpoint closed on one member of a cache group is held by another before ``close`` returns: the writer's
node can die before its upload and the checkpoint is restored on the other member from that copy; once the upload
is done the copy is dropped (root tier: real FUSE mounts, real agents on loopback)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest

from cachefs.base.types import dataset_id
from cachefs.testing.netlab import TcpForwarder
from tests.integration.test_cluster import Group
from tests.integration.test_fuse import Mounted

pytestmark = pytest.mark.root

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse (CI runs as root)", allow_module_level=True)

ENV = {"CACHEFS_CHECKPOINT_PART_SIZE": "5MiB", "CACHEFS_ORIGIN_MAX_ATTEMPTS": "2"}


def replicas_held(cache_dir: str, url: str) -> dict[str, int]:
    """What a member holds for the volume: key → size (from its replica store's records)."""
    d = os.path.join(cache_dir, "replicas", dataset_id(url))
    out = {}
    for name in os.listdir(d) if os.path.isdir(d) else ():
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                meta = json.load(f)
            out[meta["key"]] = meta["size"]
    return out


def status(cache_dir: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--json", "--cache-dir", cache_dir],
                       capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)["volumes"][0]


def test_a_checkpoint_is_restored_on_another_member_after_its_writer_died_before_the_upload(tmp_path, s3):
    server, client, bucket = s3
    url = f"s3://{bucket}/ck"
    g = Group(tmp_path, server.env(), ["n1", "n2"], url)
    origin = urlsplit(server.endpoint)
    to_origin = TcpForwarder(("127.0.0.1", 0), (origin.hostname, origin.port))  # n1's way to the origin
    mounts: list[Mounted] = []
    try:
        for n in g.names:
            g.start(n)
        (tmp_path / "mnt1").mkdir()
        writer = Mounted(g.cache("n1"), url, str(tmp_path / "mnt1"), "--writable",
                         env={**ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{to_origin.port}"})
        mounts.append(writer)
        data = random.Random(8).randbytes(7 << 20)
        to_origin.held.set()  # n1's upload is held back
        os.mkdir(writer.path("step-1"))
        with open(writer.path("step-1/model.pt"), "wb") as f:
            f.write(data)
        # close returned: the file is on n1's disk and n2 holds a copy
        assert replicas_held(g.cache("n2"), url) == {"step-1/model.pt": len(data)}
        st = status(g.cache("n1"))
        assert st["durability"].startswith("replicated") and st["below_promise_bytes"] == 0
        # n1 dies before its upload: daemon, holder and agent
        daemon = writer.wait_for_daemon()["pid"]
        for pid in (daemon, writer.proc.pid, g.procs["n1"].pid):
            os.kill(pid, signal.SIGKILL)
        writer.proc.wait(10)
        g.procs["n1"].wait(10)
        subprocess.run(["umount", "-l", writer.mountpoint], check=False)
        assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="ck/")
        # the job restarts on n2: the checkpoint is there, read from n2's copy
        (tmp_path / "mnt2").mkdir()
        restorer = Mounted(g.cache("n2"), url, str(tmp_path / "mnt2"), "--writable", env=ENV)
        mounts.append(restorer)
        with open(restorer.path("step-1/model.pt"), "rb") as f:
            assert f.read() == data
        # n1 comes back (its volume at the same mount point): its journal uploads the file, n2's copy is dropped
        to_origin.held.clear()
        g.start("n1")
        back = Mounted(g.cache("n1"), url, str(tmp_path / "mnt1"), "--writable", env=ENV)
        mounts.append(back)
        r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "sync", back.mountpoint, "--timeout", "60",
                            "--cache-dir", back.cache_dir], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert client.get_object(Bucket=bucket, Key="ck/step-1/model.pt")["Body"].read() == data
        deadline = time.monotonic() + 30
        while replicas_held(g.cache("n2"), url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert replicas_held(g.cache("n2"), url) == {}
    finally:
        to_origin.held.clear()
        for m in mounts:
            m.close()
        to_origin.close()
        g.stop()


def test_alone_a_volume_says_its_files_have_one_copy(tmp_path, s3):
    _server, _client, bucket = s3
    (tmp_path / "mnt").mkdir()
    m = Mounted(str(tmp_path / "cache"), f"s3://{bucket}/ck", str(tmp_path / "mnt"), "--writable", env=ENV)
    try:
        with open(m.path("a.bin"), "wb") as f:
            f.write(b"x" * 1000)
        assert status(m.cache_dir)["durability"].startswith("local")
    finally:
        m.close()

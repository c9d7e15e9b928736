"""The container path adds nothing: a 1 GiB file read in a pod through a cachefs volume, against the same read
through `cachefs mount` on the node itself, same origin, same run. Cold: each from a cache of its own (the node's, a
fresh tmpfs for the host's mount). Warm (the best of five reads): the host's mount over the node's cache directory,
so both read the same cached bytes (two tmpfs instances alone differ by ~10 % here: 0.078 s against 0.086 s a GiB
on a fresh one and on the node's). Every byte is checked (a second, hashing pass). Figures are printed at the end of
the run; the assertion is only that both read the right bytes (no timed assertions: these machines are noisy)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from cachefs.testing.s3server import CREDENTIALS

from .cluster import CACHE_DIR
from .conftest import REPORT
from .harness import BUCKET, IMAGE, last_json

GIB = 1 << 30

READ_TIMED = r"""
import hashlib, json, os, sys, time
path = sys.argv[1]; buf = bytearray(8 << 20); times = []
for _ in range(6):  # the first from the origin; the best of the five after it (a warm read takes ~0.1 s)
    t = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    times.append(time.monotonic() - t)
out = {"cold_s": times[0], "warm_s": min(times[1:])}
h = hashlib.sha256()
with open(path, "rb") as f:
    while chunk := f.read(8 << 20):
        h.update(chunk)
out["sha256"] = h.hexdigest()
print(json.dumps(out), flush=True)
"""


def test_a_gib_read_in_a_pod_is_as_fast_as_on_the_node(cluster, tmp_path):
    import hashlib

    h = hashlib.sha256()
    chunk = os.urandom(64 << 20)
    source = tmp_path / "one-gib.bin"
    with open(source, "wb") as f:
        for i in range(GIB // len(chunk)):
            part = bytes([i]) + chunk[1:]
            h.update(part)
            f.write(part)
    cluster.s3_client.upload_file(str(source), BUCKET, "big/one-gib.bin")
    source.unlink()
    want = h.hexdigest()
    volume = {"csi": {"driver": "csi.cachefs.io", "readOnly": True,
                      "volumeAttributes": {"url": f"s3://{BUCKET}/big", "endpointUrl": cluster.s3.endpoint,
                                           "region": "us-east-1"},
                      "nodePublishSecretRef": {"name": "dataset-credentials"}}}
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gib-reader", "namespace": "default"},
                   "spec": {"restartPolicy": "Never", "containers": [{
                       "name": "reader", "image": IMAGE, "imagePullPolicy": "Never",
                       "command": ["python3", "-c", READ_TIMED, "/data/one-gib.bin"],
                       # a CPU of its own, as a training pod asks for: a BestEffort pod gets the smallest CPU share
                       # of a node busy with the control plane, and the host's reader runs with the default share
                       "resources": {"requests": {"cpu": "900m", "memory": "256Mi"}},
                       "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]}],
                       "volumes": [{"name": "data", **volume}]}})
    assert cluster.wait_pod("gib-reader", ("Succeeded", "Failed"), timeout=600) == "Succeeded", \
        cluster.logs("gib-reader")
    pod = last_json(cluster.logs("gib-reader"))
    cluster.delete_pod("gib-reader")

    host = {"cold_s": _read_on_the_host(cluster)["cold_s"]}
    same_cache = _read_on_the_host(cluster, cache_dir=CACHE_DIR)
    host["warm_s"], host["sha256"] = same_cache["warm_s"], same_cache["sha256"]
    assert pod["sha256"] == host["sha256"] == want
    for name in ("cold_s", "warm_s"):
        ratio = host[name] / pod[name]
        where = "its own cache" if name == "cold_s" else "the node's cache"
        REPORT[f"1 GiB read, {name[:4]}: in a pod vs cachefs mount on the node ({where})"] = (
            f"pod {GIB / pod[name] / 2**20:.0f} MiB/s, node {GIB / host[name] / 2**20:.0f} MiB/s, "
            f"pod/node {ratio:.2f}x (goal >= 0.95x)")


def _read_on_the_host(cluster, cache_dir: str = "") -> dict:
    """The same read through `cachefs mount` on the node: over ``cache_dir``, or a cold cache of its own on tmpfs
    (as the node's)."""
    cache = cache_dir or tempfile.mkdtemp(prefix="cachefs-host-cache-")
    mnt = tempfile.mkdtemp(prefix="cachefs-host-mnt-")
    if not cache_dir:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "cachefs-host-cache", cache], check=True)
    env = {**os.environ, **CREDENTIALS}
    cli = [sys.executable, "-m", "cachefs.cli.main"]
    try:
        subprocess.run([*cli, "mount", f"s3://{BUCKET}/big", mnt, "--cache-dir", cache, "--endpoint-url",
                        cluster.s3.endpoint], check=True, env=env, capture_output=True, timeout=120)
        proc = subprocess.run([sys.executable, "-c", READ_TIMED, f"{mnt}/one-gib.bin"], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return last_json(proc.stdout)
    finally:
        subprocess.run([*cli, "umount", mnt, "--cache-dir", cache], env=env, capture_output=True, timeout=120)
        os.rmdir(mnt)
        if not cache_dir:
            subprocess.run(["umount", "-l", cache], check=False)
            os.rmdir(cache)

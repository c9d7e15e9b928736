"""The read path and the checkpoint write path against a second real S3 implementation, SeaweedFS, beside moto:
multipart uploads, conditional writes, copies, listings and ranged ``If-Match`` reads differ between servers.

``weed`` is built from Go modules by ``tests/s3impl/seaweedfs/build.sh`` (about 20 minutes cold on two cores, then
reused from ``.cache/``); these tests skip, saying so, when it has not been built.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import fsspec
import pytest

from cachefs.base.config import load_config
from cachefs.sources import open_object_writes, open_raw_origin
from cachefs.testing.conformance import SourceConformance, SourceOrigin
from cachefs.testing.seaweed import SeaweedServer, find_weed
from cachefs.testing.writes_conformance import ObjectWritesConformance, WritesOrigin, s3_object_getter
from tests.conftest import make_files, put_tree, with_new_bucket

pytestmark = pytest.mark.xdist_group("seaweedfs")  # one server per session, on one worker

MiB = 1 << 20


@pytest.fixture(scope="session")
def seaweed_server():
    weed = find_weed()
    if weed is None:
        pytest.skip("SeaweedFS's weed is not built (tests/s3impl/seaweedfs/build.sh)")
    with SeaweedServer(weed) as server:
        yield server


@pytest.fixture
def seaweed(seaweed_server, monkeypatch):
    """``(server, boto3 client, a new bucket)``; env points the AWS chain (and the cachefs CLI) at SeaweedFS."""
    return with_new_bucket(seaweed_server, monkeypatch)


def objects(client, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix):]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out



class TestSeaweedSource(SourceConformance):
    @pytest.fixture
    def origin(self, seaweed):
        _, client, bucket = seaweed
        src = open_raw_origin("s3://x", load_config(env={}, overrides={"cache_dir": "/tmp/unused"}))
        return SourceOrigin(src, f"s3://{bucket}/ds", lambda p, d: client.put_object(Bucket=bucket, Key=f"ds/{p}", Body=d),
                       "s3://no-such-bucket-cachefs/x")



class TestSeaweedObjectWrites(ObjectWritesConformance):
    @pytest.fixture
    def writes_origin(self, seaweed):
        _, client, bucket = seaweed

        cfg = load_config(env={}, overrides={"cache_dir": "/tmp/unused"})
        return WritesOrigin(open_object_writes(f"s3://{bucket}", cfg), f"s3://{bucket}/w",
                            s3_object_getter(client, bucket, "w"))


def cli(cache_dir: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachefs.cli.main", *args, "--cache-dir", cache_dir],
                          capture_output=True, text=True, timeout=300)


def test_a_dataset_is_prefetched_and_read_back_through_the_cache(seaweed, cache_dir):
    """The read path's main job: prefetch (packs for the small files, ranged block GETs pinned by ETag for the big
    ones), then every byte read back from the node, with the origin's objects changed meanwhile refused as stale."""
    _, client, bucket = seaweed
    files = make_files(n_small=40, big_sizes=(9 * MiB + 5, 300_000))
    put_tree(client, bucket, "ds", files)
    url = f"s3://{bucket}/ds"
    r = cli(cache_dir, "prefetch", url)
    assert r.returncode == 0, r.stderr
    fs = fsspec.filesystem("cachefs", cache_dir=cache_dir, skip_instance_cache=True)
    for name, data in files.items():
        assert fs.cat(f"{bucket}/ds/{name}") == data, name
    status = json.loads(cli(cache_dir, "status", "--json").stdout)
    assert status["datasets"][0]["cached_bytes"] >= sum(len(d) for d in files.values())


def run(code: str, cache_dir: str) -> subprocess.CompletedProcess:
    """``code`` in a process of its own (a training process), with small multipart parts."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CACHEFS_CACHE_DIR": cache_dir, "CACHEFS_CACHE_MIN_FREE": "0",
                               "CACHEFS_CHECKPOINT_PART_SIZE": "5MiB"})


def test_a_checkpoint_directory_is_uploaded_in_parts_and_committed(seaweed, cache_dir):
    """A DCP-style checkpoint written through the fsspec front door: shards (multipart), ``.metadata`` last, the
    directory renamed onto its final name; on the origin whole, with its commit record, listed as committed."""
    _, client, bucket = seaweed
    rng = random.Random(5)
    shards = {f"__{i}_0.distcp": rng.randbytes(6 * MiB + i) for i in range(3)}
    shards[".metadata"] = b"metadata last"
    r = run(f"""
        import fsspec, random
        rng = random.Random(5)
        fs = fsspec.filesystem("cachefs", writable=True, volume="s3://{bucket}/ck")
        fs.mkdir("{bucket}/ck/step-4.tmp")
        for i in range(3):
            fs.pipe("{bucket}/ck/step-4.tmp/__%d_0.distcp" % i, rng.randbytes(6 * 1024 * 1024 + i))
        fs.pipe("{bucket}/ck/step-4.tmp/.metadata", b"metadata last")
        fs.mv("{bucket}/ck/step-4.tmp", "{bucket}/ck/step-4", recursive=True)
    """, cache_dir)
    assert r.returncode == 0, r.stderr
    assert objects(client, bucket, "ck/step-4/") == shards
    assert not objects(client, bucket, "ck/step-4.tmp/")
    listed = cli(cache_dir, "checkpoints", f"s3://{bucket}/ck", "--json")
    assert listed.returncode == 0, listed.stderr
    [record] = json.loads(listed.stdout)
    assert record["name"] == "step-4" and record["bytes"] == sum(len(v) for v in shards.values())


def test_two_writers_racing_on_one_checkpoint_one_wins(seaweed, tmp_path):
    """Two processes (two nodes' volumes) commit the same name: the conditional claim lets one through; the other's
    objects never reach it."""
    _, client, bucket = seaweed
    code = f"""
        import sys, fsspec
        fill = int(sys.argv[1])
        fs = fsspec.filesystem("cachefs", writable=True, volume="s3://{bucket}/ck")
        fs.mkdir("{bucket}/ck/step-9.tmp")
        fs.pipe("{bucket}/ck/step-9.tmp/a", bytes([fill]) * 300_000)
        fs.pipe("{bucket}/ck/step-9.tmp/b", bytes([fill + 10]) * 200_000)
        fs.mv("{bucket}/ck/step-9.tmp", "{bucket}/ck/step-9", recursive=True)
    """
    env = {**os.environ, "CACHEFS_CACHE_MIN_FREE": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**env, "CACHEFS_CACHE_DIR": str(tmp_path / f"c{i}")})
             for i in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    got = objects(client, bucket, "ck/step-9/")
    assert set(got) == {"a", "b"}
    fill = got["a"][0]
    assert got == {"a": bytes([fill]) * 300_000, "b": bytes([fill + 10]) * 200_000}  # one writer's, whole
    loser = (1, 2).index(3 - fill)
    assert "committed by another writer" in outs[loser][1], outs

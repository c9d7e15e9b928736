"""Manifests at scale: 1,000,000 entries from a local ``file://`` tree and 100,000 objects listed from S3 (moto's
server), stored in LMDB, read back by other processes without loading the manifest into memory, and never
listed from the origin twice."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import replace

from cachefs.base.config import OriginConfig
from cachefs.engine import Engine

DIRS = 10
PER_DIR = 100_000

#: Run in a fresh process: open the dataset from the node's manifest, stat entries, list one directory, and
#: report the peak RSS. The origin is gone by then, so everything must come from the manifest.
READER = r"""
import asyncio, json, resource, sys
from cachefs.base.config import load_config
from cachefs.engine import Engine

url, cache_dir, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
engine = Engine(load_config(env={}, overrides={"cache_dir": cache_dir}))
ds = asyncio.run(engine.open_dataset(url))
sizes = {n: ds.stat(n).size for n in names}
listed = sum(1 for _ in ds.manifests.listdir(ds.ref.id, ds.version, "d7"))
engine.close()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"sizes": sizes, "listed": listed, "rss_growth_kib": after - before}))
"""


def read_in_another_process(url: str, cache_dir: str, names: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", READER, url, cache_dir, json.dumps(names)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_million_entry_manifest_from_a_local_tree(tmp_path, config):
    root = tmp_path / "origin"
    try:
        for d in range(DIRS):
            path = root / f"d{d}"
            path.mkdir(parents=True)
            for i in range(PER_DIR):
                fd = os.open(f"{path}/f{i:06d}", os.O_CREAT | os.O_WRONLY, 0o644)
                if i % 10_000 == 0:
                    os.write(fd, b"x" * (i // 10_000 + 1))  # a few sized files, to check sizes come through
                os.close(fd)
        url = f"file://{root}"
        engine = Engine(config)
        try:
            ds = asyncio.run(engine.open_dataset(url))
            assert sum(1 for _ in ds.walk_files()) == DIRS * PER_DIR
            assert [e.path for e in ds.listdir("d3")] == [f"d3/f{i:06d}" for i in range(PER_DIR)]
            assert ds.stat("d5/f050000").size == 6 and ds.stat("d5/f050001").size == 0
            info = ds.record.manifest(ds.version)
            assert (info.files, info.largest) == (DIRS * PER_DIR, 10)
        finally:
            engine.close()
        rng = random.Random(1)
        names = [f"d{rng.randrange(DIRS)}/f{rng.randrange(PER_DIR):06d}" for _ in range(2000)]
        want = {n: os.stat(root / n).st_size for n in names}
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the origin is gone from here on
    got = read_in_another_process(url, config.cache.dir, names)
    assert got["sizes"] == want and got["listed"] == PER_DIR
    # 1M entries held in memory as objects would take hundreds of MiB; a reader maps LMDB pages instead.
    assert got["rss_growth_kib"] < 96 * 1024, got["rss_growth_kib"]


def test_a_hundred_thousand_objects_listed_from_s3(s3, config):
    # moto scans the whole bucket for every listing page (seconds each at 100,000 keys on a loaded 2-core
    # machine, with ten prefixes listed at once), so this test allows the default request timeout, not 5 s.
    config = replace(config, origin=replace(config.origin, request_timeout=OriginConfig().request_timeout))
    server, client, bucket = s3
    count = 100_000
    server.seed(bucket, "ds", count, dirs=DIRS)
    client.put_object(Bucket=bucket, Key="ds/d7/sized.bin", Body=b"12345")
    url = f"s3://{bucket}/ds"
    engine = Engine(config)
    try:
        ds = asyncio.run(engine.open_dataset(url))
        assert sum(1 for _ in ds.walk_files()) == count + 1
        listed = ds.listdir("d7")
        assert len(listed) == count // DIRS + 1 and ds.stat("d7/sized.bin").size == 5
        assert ds.record.manifest(ds.version).largest == 5
        assert {e.path for e in listed} == {f"d7/f{i:07d}" for i in range(7, count, DIRS)} | {"d7/sized.bin"}
    finally:
        engine.close()
    server.reset()  # the bucket is gone: a second process lists and stats from the node's manifest alone
    got = read_in_another_process(url, config.cache.dir, ["d7/sized.bin", "d3/f0000003"])
    assert got["sizes"] == {"d7/sized.bin": 5, "d3/f0000003": 0} and got["listed"] == count // DIRS + 1

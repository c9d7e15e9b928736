"""Manifest scale: a directory of 1,000,000 entries stored, listed and stat'ed; a 100,000-file local tree
snapshotted through the real listing path, and (as root) walked through the FUSE mount; a 100,000-object S3
bucket (the local test server) snapshotted with cachefs's own listing requests and with botocore's. Ratios are
against ``os.scandir``/``os.stat`` of the same local tree, or botocore's listing, measured in the same run.

    python -m bench.manifest_bench [--entries 1000000] [--tree 100000] [--s3 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time

from cachefs.base.config import load_config
from cachefs.base.types import Entry
from cachefs.engine import Engine
from cachefs.index import Index
from cachefs.manifest import ManifestStore, ManifestWriter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--tree", type=int, default=100_000)
    p.add_argument("--s3", type=int, default=100_000, help="objects in the S3 snapshot pass (0: skip it)")
    p.add_argument("--rounds", type=int, default=2, help="S3 snapshots per listing path, interleaved")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="cachefs-mbench-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    try:
        one_big_directory(work, args.entries)
        local_tree(work, args.tree)
        if args.s3:
            s3_snapshot(work, args.s3, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def one_big_directory(work: str, n: int) -> None:
    index = Index(os.path.join(work, "cache1"))
    w = ManifestWriter(index, "0" * 16, 1)
    t = time.perf_counter()
    batch = []
    for i in range(n):
        batch.append(Entry(f"train/img-{i:08d}.jpg", 100_000 + i % 1000, f"etag{i}", 1.7e9))
        if len(batch) == 10_000:
            w.add(batch)
            batch = []
    w.add(batch)
    build = time.perf_counter() - t
    store = ManifestStore(index)
    t = time.perf_counter()
    count = sum(1 for _ in store.listdir("0" * 16, 1, "train"))
    listing = time.perf_counter() - t
    names = [f"train/img-{random.randrange(n):08d}.jpg" for _ in range(100_000)]
    t = time.perf_counter()
    for name in names:
        store.lookup("0" * 16, 1, name)
    stat_us = (time.perf_counter() - t) / len(names) * 1e6
    print(f"1 directory × {count:,} entries: stored in {build:.1f}s, listdir {listing:.2f}s "
          f"({count / listing:,.0f} entries/s), stat {stat_us:.1f} µs each (100,000 random names)")


def local_tree(work: str, n: int) -> None:
    root = os.path.join(work, "tree")
    for i in range(n):
        d = os.path.join(root, f"d{i % 100:03d}")
        if i < 100:
            os.makedirs(d)
        open(os.path.join(d, f"f{i:07d}"), "wb").close()
    cfg = load_config(env={}, overrides={"cache_dir": os.path.join(work, "cache2")})
    engine = Engine(cfg)

    async def snap():
        t = time.perf_counter()
        ds = await engine.open_dataset(f"file://{root}")
        return ds, time.perf_counter() - t

    ds, took = asyncio.run(snap())
    t = time.perf_counter()
    count = sum(1 for _ in ds.walk_files())
    walk = time.perf_counter() - t
    local_walk, local = walk_and_stat(root, drop=False)
    t = time.perf_counter()
    for e in ds.walk_files():
        ds.stat(e.path)
    walk_stat = walk + (time.perf_counter() - t)
    assert count == local == n
    engine.close()
    print(f"local tree of {n:,} files: manifest taken in {took:.1f}s; walk from manifest {walk:.2f}s, "
          f"walk+stat {walk_stat:.2f}s vs os.walk+os.stat {local_walk:.2f}s → {local_walk / walk_stat:.2f}×")
    if os.geteuid() == 0:
        walk_through_mount(work, root, os.path.join(work, "cache2"), n)


def walk_and_stat(root: str, *, drop: bool = True) -> tuple[float, int]:
    """Seconds and files of ``os.walk`` + ``os.stat`` over ``root`` (caches dropped first when ``drop``)."""
    from bench.read_bench import drop_caches

    if drop:
        drop_caches()
    t = time.perf_counter()
    count = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            os.stat(os.path.join(dirpath, f))
            count += 1
    return time.perf_counter() - t, count


def walk_through_mount(work: str, root: str, cache: str, n: int) -> None:
    """``os.walk`` + ``os.stat`` over the FUSE mount of the tree's manifest vs over the tree itself (dentry,
    inode and page caches dropped before each)."""
    import subprocess
    import sys

    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    subprocess.run([sys.executable, "-m", "cachefs.cli.main", "mount", f"file://{root}", mnt, "--cache-dir", cache],
                   check=True, stdout=subprocess.DEVNULL)
    try:
        mine, local = [], []
        for _ in range(2):
            secs, count = walk_and_stat(root)
            assert count == n
            local.append(secs)
            secs, count = walk_and_stat(mnt)
            assert count == n, (count, n)
            mine.append(secs)
        m, b = min(mine), min(local)
        print(f"os.walk + os.stat of {n:,} files through the FUSE mount {m:.2f}s vs the local tree {b:.2f}s "
              f"= {m / b:.2f}× the time (target ≤ 2×)")
    finally:
        subprocess.run([sys.executable, "-m", "cachefs.cli.main", "umount", mnt], check=False)


def s3_snapshot(work: str, n: int, rounds: int) -> None:
    """Take the manifest of an ``n``-object bucket on the local S3 server (its fast listing, so that the client
    is what is measured), once with cachefs's own signed listing requests and once through botocore
    (``origin.direct_get: false``), interleaved; wall and CPU seconds of this process."""
    import statistics

    from cachefs.testing.s3server import S3Server

    with S3Server(fast=True) as server:
        os.environ.update(server.env())
        client = server.client()
        client.create_bucket(Bucket="bench")
        server.seed("bench", "ds", n, dirs=1000)
        took: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for r in range(rounds * 2):
            direct = r % 2 == 1
            cfg = load_config(env={}, overrides={"cache_dir": os.path.join(work, f"cache-s3-{r}"),
                                                 "origin_direct_get": direct})
            engine = Engine(cfg)

            async def snap(engine=engine, direct=direct):
                src = engine.source_for("s3://bench/ds")
                await src.connect()  # (the client's set-up is not the listing)
                t, c = time.perf_counter(), time.process_time()
                ds = await engine.open_dataset("s3://bench/ds")
                took[direct].append((time.perf_counter() - t, time.process_time() - c))
                assert sum(1 for _ in ds.walk_files()) == n
                await engine.aclose()

            asyncio.run(snap())
        ours, theirs = (statistics.median(w for w, _ in took[d]) for d in (True, False))
        our_cpu, their_cpu = (statistics.median(c for _, c in took[d]) for d in (True, False))
        print(f"S3 bucket of {n:,} objects: manifest taken in {ours:.1f}s ({n / ours:,.0f} objects/s, CPU "
              f"{our_cpu:.1f}s) with cachefs's listing requests vs {theirs:.1f}s (CPU {their_cpu:.1f}s) through "
              f"botocore = {theirs / ours:.1f}× faster")


if __name__ == "__main__":
    main()

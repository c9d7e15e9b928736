"""``cachefs demo``: the whole read path on an embedded default.

Starts moto's S3 server on a free loopback port, uploads a generated dataset (a few large files and a tree
of a few thousand small ones), prefetches it through cachefs into a fresh cache directory, reads every file
back through the ``cachefs::s3://`` fsspec door, checks each against the bytes uploaded, and prints what
happened.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from cachefs.base.config import Config, parse_size
from cachefs.base.values import human_bytes
from cachefs.cli.progress import ProgressPrinter
from cachefs.engine import Engine
from cachefs.jobs import warm

BUCKET = "cachefs-demo"
PREFIX = "sample"


def generate(small_files: int, large_files: int, large_size: int, seed: int = 7) -> dict[str, bytes]:
    """A deterministic sample dataset: ``large/part-N.bin`` and ``train/class-XX/img-NNNNN.bin`` (1–64 KiB)."""
    rng = random.Random(seed)
    files = {f"large/part-{i}.bin": rng.randbytes(large_size) for i in range(large_files)}
    for i in range(small_files):
        files[f"train/class-{i % 40:02d}/img-{i:05d}.bin"] = rng.randbytes(rng.randint(1024, 64 * 1024))
    return files


async def run_demo(args: argparse.Namespace, config: Config) -> int:
    from cachefs.testing.s3server import S3Server

    files = generate(args.small_files, args.large_files, parse_size(args.large_size, "--large-size"))
    total = sum(len(b) for b in files.values())
    print(f"demo: {len(files)} files, {human_bytes(total)} "
          f"({args.large_files} large, {args.small_files} small)")
    with S3Server() as server, tempfile.TemporaryDirectory(prefix="cachefs-demo-") as tmp:
        t0 = time.monotonic()
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda kv: client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{kv[0]}", Body=kv[1]),
                          files.items()))
        print(f"demo: local S3 server at {server.endpoint}, uploaded in {time.monotonic() - t0:.1f}s")

        cache_dir = args.cache_dir or f"{tmp}/cache"
        cfg = dataclasses.replace(
            config,
            cache=dataclasses.replace(config.cache, dir=cache_dir),
            origin=dataclasses.replace(config.origin, endpoint_url=server.endpoint, region="us-east-1",
                                       access_key_id="testing", secret_access_key="testing"),
        ).validate()
        url = f"s3://{BUCKET}/{PREFIX}"

        engine = Engine(cfg)
        try:
            t0 = time.monotonic()
            ds = await engine.open_dataset(url)
            t_manifest = time.monotonic() - t0
            printer = ProgressPrinter()
            prog = await warm(engine, ds, on_progress=printer)
            printer.finish(prog)
        finally:
            await engine.aclose()
        print(f"prefetch: manifest of {prog.files_total} files in {t_manifest:.2f}s; "
              f"{human_bytes(prog.bytes_fetched)} fetched in {prog.elapsed:.2f}s ({human_bytes(prog.rate)}/s)")

        t0 = time.monotonic()
        bad, hit, miss = await asyncio.to_thread(_read_back, cache_dir, server.endpoint, url, files)
        elapsed = time.monotonic() - t0
        print(f"read back: {len(files)} files, {human_bytes(total)} in {elapsed:.2f}s "
              f"({human_bytes(total / elapsed)}/s) through cachefs::{url}; "
              f"hit ratio {100 * hit / max(1, hit + miss):.1f}%; mismatches: {bad}")
        return 1 if bad else 0


def _read_back(cache_dir: str, endpoint: str, url: str, files: dict[str, bytes]) -> tuple[int, int, int]:
    import fsspec

    opts = {"cachefs": {"cache_dir": cache_dir, "dataset": url},
            "s3": {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
                   "client_kwargs": {"region_name": "us-east-1"}}}
    bad = 0
    fs, _ = fsspec.core.url_to_fs(f"cachefs::{url}", **opts)
    fs.info(url.split("://", 1)[1])
    before = fs.engine.index.dataset_stats(fs._datasets[url].ref.id)
    for rel, want in files.items():
        with fs.open(f"{url.split('://', 1)[1]}/{rel}", "rb") as f:
            got = f.read()
        if hashlib.sha256(got).digest() != hashlib.sha256(want).digest():
            bad += 1
    fs.engine.flush_stats()
    st = fs.engine.index.dataset_stats(fs._datasets[url].ref.id)
    return bad, st.hit_bytes - before.hit_bytes, st.miss_bytes - before.miss_bytes

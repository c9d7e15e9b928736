"""webdataset shards through cachefs three ways, against the same-run yardsticks (docs/LOADERS.md).

* ``url``: ``wds.WebDataset("cachefs://bucket/wds/shard-{...}.tar")`` (cachefs.loaders.register_webdataset);
* ``order``: the same, with the shard order published first (``cachefs.publish_order``), as a job that shuffles
  its shards and knows the order would;
* ``pipe``: ``wds.WebDataset("pipe:cat MOUNT/shard-{...}.tar")`` over a cachefs mount (webdataset's own way out);
* ``mount``: ``wds.WebDataset("MOUNT/shard-{...}.tar")``, a plain path on the mount (root: FUSE).

Each way starts from an empty cache: epoch 1 (cold) is set beside bare GETs of every shard by a client that keeps
nothing, one after another as webdataset reads them (the least a shard-by-shard reader must wait for), epoch 2
(warm) beside webdataset reading a copy of the shards on local disk. Origin GETs are counted by the server. Every
sample is checked against the shard written.

    python -m bench.loaders_bench [--shards 16 --shard-mib 4 --delay-ms 10]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import tarfile
import tempfile
import time

from bench.fuse_bench import cachefs_mount
from bench.read_bench import server_ceiling
from cachefs.testing.s3server import S3Server


def make_shards(n: int, shard_bytes: int, per_shard: int, seed: int = 11) -> tuple[dict[str, bytes], dict[str, bytes]]:
    rng = random.Random(seed)
    shards, samples = {}, {}
    for s in range(n):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(per_shard):
                key, data = f"s{s:04d}_{i:04d}", rng.randbytes(shard_bytes // per_shard)
                samples[key] = data
                info = tarfile.TarInfo(f"{key}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        shards[f"wds/shard-{s:04d}.tar"] = buf.getvalue()
    return shards, samples


def epoch(url: str, samples: dict[str, bytes]) -> float:
    import webdataset as wds

    t = time.perf_counter()
    got = 0
    for sample in wds.WebDataset(url, shardshuffle=False):
        if samples[sample["__key__"]] != sample["bin"]:
            raise SystemExit(f"wrong bytes in {sample['__key__']} from {url}")
        got += 1
    if got != len(samples):
        raise SystemExit(f"{url}: {got} of {len(samples)} samples")
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--shard-mib", type=float, default=4)
    p.add_argument("--per-shard", type=int, default=64, help="samples per shard")
    p.add_argument("--delay-ms", type=float, default=10, help="added to every origin request")
    a = p.parse_args()
    from cachefs import publish_order
    from cachefs.loaders import register_webdataset

    shards, samples = make_shards(a.shards, int(a.shard_mib * (1 << 20)), a.per_shard)
    total = sum(len(b) for b in shards.values())
    brace = f"shard-{{0000..{a.shards - 1:04d}}}.tar"
    work = tempfile.mkdtemp(prefix="loaders-bench-")
    local = os.path.join(work, "local")
    os.makedirs(local)
    for key, body in shards.items():
        with open(os.path.join(local, os.path.basename(key)), "wb") as f:
            f.write(body)
    rows = []
    try:
        with S3Server(delay_ms=a.delay_ms, fast=True) as server:
            os.environ.update(server.env())  # (credentials for the mounts and the fsspec layer)
            client = server.client()
            client.create_bucket(Bucket="bench")
            for key, body in shards.items():
                client.put_object(Bucket="bench", Key=key, Body=body)
            # webdataset reads one shard after another: one GET at a time is what it must wait for at least
            bare = server_ceiling(server.endpoint, list(shards), in_flight=1)
            local_s = min(epoch(f"{local}/{brace}", samples) for _ in range(2))
            for way in ("url", "order", "pipe", "mount"):
                cache, mnt = os.path.join(work, f"cache-{way}"), os.path.join(work, f"mnt-{way}")
                os.makedirs(mnt)
                mount = None
                if way in ("url", "order"):
                    register_webdataset(cachefs={"cache_dir": cache, "s3": {"endpoint_url": server.endpoint}})
                    url = f"cachefs://bench/wds/{brace}"
                else:
                    mount = cachefs_mount("s3://bench/wds", mnt, cache, "--endpoint-url", server.endpoint)
                    url = f"pipe:cat {mnt}/{brace}" if way == "pipe" else f"{mnt}/{brace}"
                try:
                    times, origin = [], []
                    for _ in range(2):
                        if way == "order":
                            publish_order("s3://bench/wds", [os.path.basename(k) for k in sorted(shards)],
                                          cache_dir=cache)
                        server.requests(reset=True)
                        times.append(epoch(url, samples))
                        gets = server.requests()["gets"]
                        origin.append(sum(n for k, n in gets.items() if "/bench/wds/" in k))
                finally:
                    if mount:
                        mount.close()
                rows.append((way, times, origin))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = total / (1 << 20)
    print(f"{a.shards} shards, {mib:.0f} MiB, {len(samples)} samples; origin +{a.delay_ms:g} ms a request")
    print(f"yardsticks: bare GETs of every shard, one at a time {mib / bare:.0f} MiB/s; "
          f"webdataset on a local copy {mib / local_s:.0f} MiB/s")
    print(f"{'way':6} {'cold MiB/s':>10} {'vs bare GETs':>12} {'warm MiB/s':>10} {'vs local':>9} "
          f"{'origin GETs (cold, warm)':>26}")
    for way, (cold, warm), (g1, g2) in rows:
        print(f"{way:6} {mib / cold:10.0f} {bare / cold:11.2f}x {mib / warm:10.0f} {local_s / warm:8.2f}x {g1:>18}, {g2}")


if __name__ == "__main__":
    main()

"""Memory under load: 64 concurrent readers (threads, through the fsspec door) read cold large objects in
1 MiB reads while the engine's memory budget is set low; the process's peak RSS growth is printed next to
the budget. A baseline of the same process before the readers start is subtracted.

    python -m bench.memory_bench [--budget 128MiB] [--readers 64]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import fsspec

from cachefs.base.config import parse_size


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget", default="128MiB")
    p.add_argument("--readers", type=int, default=64)
    p.add_argument("--objects", type=int, default=8)
    p.add_argument("--object-mib", type=int, default=64)
    args = p.parse_args()

    from cachefs.testing.s3server import S3Server

    with S3Server(fast=True, delay_ms=5) as server:
        client = server.client()
        client.create_bucket(Bucket="mem")
        for i in range(args.objects):
            client.put_object(Bucket="mem", Key=f"ds/o{i}.bin", Body=os.urandom(args.object_mib << 20))
        os.environ.update(server.env())
        fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=tempfile.mkdtemp(prefix="cachefs-mem-"),
                               dataset="s3://mem/ds", engine_memory_budget=args.budget)
        fs._open_dataset("s3://mem/ds")
        base = rss_mib()
        peak = [base]
        done = [False]

        def sample():
            while not done[0]:
                peak[0] = max(peak[0], rss_mib())
                time.sleep(0.01)

        def reader(i):
            with fs.open(f"mem/ds/o{i % args.objects}.bin", "rb") as f:
                while f.read(1 << 20):
                    pass

        with ThreadPoolExecutor(1) as sampler:
            sampler.submit(sample)
            t = time.perf_counter()
            with ThreadPoolExecutor(args.readers) as pool:
                list(pool.map(reader, range(args.readers)))
            elapsed = time.perf_counter() - t
            done[0] = True
        budget = parse_size(args.budget) / 2**20
        print(f"{args.readers} readers over {args.objects} × {args.object_mib} MiB cold objects in {elapsed:.1f}s: "
              f"RSS {base:.0f} MiB before, peak {peak[0]:.0f} MiB (+{peak[0] - base:.0f} MiB) with a {budget:.0f} MiB "
              f"budget (engine peak in flight {fs.engine.budget.peak / 2**20:.0f} MiB); "
              f"ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()

"""The first epoch's reader: files read once each, in a seeded random order, through a mount on an empty cache,
against rclone's mount (``--vfs-cache-mode full``) of the same S3 server, in one run.

Two origins, one after the other: moto's S3 server on loopback with no added latency (a fast origin: here it is
bound by these two CPUs, shared with the mount and the reader), and the same server with a per-request delay
(default 10 ms) behind a ``tc tbf``-capped veth into a network namespace made for the run (root only). For each,
one reader and N reader processes read the first ``--read`` files of a seeded shuffle of the whole tree
(20,000 files of 4–64 KiB in 100 directories, as bench/small_files_bench.py).

Printed per row: files/s (median of ``--rounds`` interleaved rounds, a fresh cache each) and the GETs the server
answered per file read, for cachefs and rclone, and two yardsticks measured in the same run: one file per round trip
(the median time of one bare GET, one at a time: what a reader without read-ahead cannot beat) and the whole dataset
by bare GETs, 128 in flight (the most this server and machine give any client).

    python -m bench.cold_reader_bench                  # both origins
    python -m bench.cold_reader_bench --origins fast   # loopback only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from bench.fuse_bench import cachefs_mount, parallel_read, rclone_mount, split
from bench.read_bench import NS, NS_IP, drop_caches, make_link, server_ceiling, teardown_link


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=20_000, help="files in the tree")
    p.add_argument("--read", type=int, default=1_000, help="files each pass reads (the first of the shuffle)")
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--rate-mbit", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--origins", default="fast,far", help="fast (loopback), far (delay behind the link), or both")
    p.add_argument("--systems", default="cachefs,rclone")
    args = p.parse_args()
    systems = args.systems.split(",")
    if shutil.which("rclone") is None and "rclone" in systems:
        systems.remove("rclone")
        print("# rclone is not installed: cachefs alone")
    for origin in args.origins.split(","):
        if origin not in ("fast", "far"):
            p.error("--origins: fast, far")
        run_origin(args, origin, systems)


def run_origin(args, origin: str, systems: list[str]) -> None:
    from cachefs.testing.s3server import S3Server

    capped = origin == "far" and make_link(args.rate_mbit)
    delay = args.delay_ms if origin == "far" else 0.0
    work = tempfile.mkdtemp(prefix="cachefs-bench-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    server = S3Server(host=NS_IP if capped else "127.0.0.1", delay_ms=delay, netns=NS if capped else None, fast=True)
    try:
        server.start()
        os.environ.update(server.env())
        names, nbytes = _seed(server, args.files, args.seed)
        picked = names[:args.read]
        rtt = _one_get(server, picked[:50])
        where = (f"+{delay:g} ms/request, {args.rate_mbit} Mbit/s tbf into netns {NS}" if capped
                 else f"+{delay:g} ms/request, loopback")
        print(f"# origin {origin}: moto S3 {where}; {args.files} files ({nbytes / 2**20:.0f} MiB), each pass reads "
              f"{len(picked)} in a seeded random order; {os.cpu_count()} CPUs")
        print(f"  one bare GET at a time: {rtt * 1000:.2f} ms = {1 / rtt:.0f} files/s (one file per round trip)")
        ceiling = server_ceiling(server.endpoint, [f"small/{n}" for n in names])
        print(f"  every object by bare GETs, 128 in flight, nothing stored: {ceiling:.1f} s = "
              f"{len(names) / ceiling:,.0f} files/s, {nbytes / ceiling / 1e6:.0f} MB/s (the most this server and "
              f"machine give any client; a reader whose read-ahead fetched the whole dataset first could read "
              f"{len(picked)} files in that time at best: {len(picked) / ceiling:,.0f} files/s)")
        for n in (1, args.readers):
            results: dict[str, list[tuple[float, float]]] = {s: [] for s in systems}
            for r in range(args.rounds):
                for system in systems:
                    results[system].append(_cold_pass(server, system, picked, n, os.path.join(work, f"{system}-{r}")))
            line = []
            for system in systems:
                rate = statistics.median(x[0] for x in results[system])
                gets = statistics.median(x[1] for x in results[system])
                line.append(f"{system} {rate:7.0f} files/s ({gets:.1f} GETs/file)")
            best_peer = max((statistics.median(x[0] for x in results[s]) for s in systems if s != "cachefs"),
                            default=None)
            mine = statistics.median(x[0] for x in results["cachefs"]) if "cachefs" in results else None
            ratios = ""
            if mine is not None:
                ratios = f"; cachefs = {mine * rtt:.2f}× one file per round trip" if n == 1 else ""
                if best_peer:
                    ratios += f", {mine / best_peer:.2f}× the best peer"
            print(f"  cold x{n}: " + ", ".join(line) + ratios)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        if capped:
            teardown_link()


def _seed(server, count: int, seed: int) -> tuple[list[str], int]:
    client = server.client()
    client.create_bucket(Bucket="bench")
    rng = random.Random(seed)
    files = {f"c{i % 100:03d}/f{i:06d}.jpg": rng.randbytes(rng.randint(4 << 10, 64 << 10)) for i in range(count)}
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket="bench", Key=f"small/{kv[0]}", Body=kv[1]), files.items()))
    names = list(files)
    random.Random(seed).shuffle(names)
    return names, sum(map(len, files.values()))


def _one_get(server, names: list[str]) -> float:
    client = server.client()
    times = []
    for name in names:
        t = time.perf_counter()
        client.get_object(Bucket="bench", Key=f"small/{name}")["Body"].read()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _gets(server, reset: bool = False) -> int:
    with urllib.request.urlopen(f"{server.endpoint}/_cachefs/requests{'?reset=1' if reset else ''}", timeout=30) as r:
        counts = json.load(r)
    return sum(counts["gets"].values())


def _cold_pass(server, system: str, picked: list[str], readers: int, work: str) -> tuple[float, float]:
    """(files/s, GETs per file read) of ``readers`` processes reading ``picked`` through a fresh mount."""
    mnt, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
    os.makedirs(mnt)
    if system == "cachefs":
        mount = cachefs_mount("s3://bench/small", mnt, cache)
        root = mnt
    else:
        creds = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
        mount = rclone_mount(server.endpoint, mnt, cache, creds, work)
        root = os.path.join(mnt, "small")
    try:
        os.listdir(root)  # mounted and listed: the pass times reads
        drop_caches()
        _gets(server, reset=True)
        secs, _ = parallel_read(split([os.path.join(root, x) for x in picked], readers))
        gets = _gets(server)
    finally:
        mount.close()
        shutil.rmtree(work, ignore_errors=True)
    return len(picked) / secs, gets / len(picked)


if __name__ == "__main__":
    main()

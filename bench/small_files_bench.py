"""Small-file benchmark: packed small files (the default) against one local file per object
(``cache.pack_threshold=0``), plain local disk, and the link's capacity, in one run.

The origin is moto's S3 server with a per-request delay (default 10 ms) behind a ``tc tbf``-capped veth into a
network namespace made for the run (as root; otherwise loopback, said in the output), as in bench/read_bench.py.

Passes, for each cache layout (packed / per-file):

* **cold prefetch** of the whole tree (``cachefs prefetch``): MB/s against the link's capacity;
* **cold prefetch through a packed mirror** (``cachefs pack`` first, then a node with an empty cache);
* **cold read through the mount** (packed layout), 1 and N reader processes in the seeded random order a
  training loader uses, on an empty cache: before the mirror exists (a GET per file, plus the directory
  read-ahead a miss starts) and through it (a miss brings the pack window holding the file, and the windows
  after it);
* **warm reads**, page cache dropped before every pass (cachefs's and the local tree's alike), files in a
  seeded random order, 1 and N reader processes: through the FUSE mount and through fsspec (``cachefs::``),
  against the same tree on local disk.

Every figure is a median over interleaved rounds, printed as a ratio to its same-run baseline.

    python -m bench.small_files_bench                      # 20,000 files of 4–64 KiB (~650 MiB)
    python -m bench.small_files_bench --small 4000         # quicker
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench.fuse_bench import cachefs_mount, parallel_read, split
from bench.read_bench import NS, drop_caches, origin_on_link, server_ceiling


def _fsspec_read(names: list[str], cache: str, url: str, env: dict, start, done) -> None:
    import fsspec

    os.environ.update(env)
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache, dataset=url, skip_instance_cache=True)
    base = url.split("://", 1)[1]
    fs.cat_file(f"{base}/{names[0]}")  # open the dataset before the clock starts
    start.wait()
    n = 0
    for name in names:
        n += len(fs.cat_file(f"{base}/{name}"))
    done.put((time.perf_counter(), n))


def fsspec_parallel(groups: list[list[str]], cache: str, url: str) -> tuple[float, int]:
    ctx = mp.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "CACHEFS_"))}
    procs = [ctx.Process(target=_fsspec_read, args=(g, cache, url, env, start, done)) for g in groups]
    for p in procs:
        p.start()
    time.sleep(3.0)  # spawn + imports + dataset open
    t0 = time.perf_counter()
    start.set()
    results = [done.get() for _ in procs]
    for p in procs:
        p.join()
    return max(t for t, _ in results) - t0, sum(n for _, n in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=int, default=20_000)
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--rate-mbit", type=int, default=1000)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--passes", default="cold,warm,mirror",
                   help="comma-separated subset of cold, warm, mirror (warm needs cold)")
    args = p.parse_args()
    args.passes = set(args.passes.split(","))
    if not args.passes <= {"cold", "warm", "mirror"} or ("warm" in args.passes and "cold" not in args.passes):
        p.error("--passes: a subset of cold,warm,mirror; warm needs cold")

    with origin_on_link(args.rate_mbit, args.delay_ms) as (server, work, capped):
        run(args, server, work, capped)


def run(args, server, work: str, capped: bool) -> None:
    os.environ.update(server.env())
    client = server.client()
    client.create_bucket(Bucket="bench")
    rng = random.Random(args.seed)
    files = {f"c{i % 100:03d}/f{i:06d}.jpg": rng.randbytes(rng.randint(4 << 10, 64 << 10)) for i in range(args.small)}
    local = os.path.join(work, "local")
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(local, rel)), exist_ok=True)
        with open(os.path.join(local, rel), "wb") as f:
            f.write(data)
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket="bench", Key=f"small/{kv[0]}", Body=kv[1]), files.items()))
    nbytes = sum(map(len, files.values()))
    link = f"{args.rate_mbit} Mbit/s tbf into netns {NS}" if capped else "loopback, NO bandwidth cap"
    print(f"# {len(files)} files of 4–64 KiB ({nbytes / 2**20:.0f} MiB); moto S3 +{args.delay_ms:g} ms/request, {link}; "
          f"{os.cpu_count()} CPUs; page cache dropped before every warm pass")
    names = list(files)
    random.Random(args.seed).shuffle(names)
    del files
    url = "s3://bench/small"
    cli = [sys.executable, "-m", "cachefs.cli.main"]
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    local_paths = [os.path.join(local, n) for n in names]
    cold: dict[str, float] = {}
    if "cold" in args.passes:
        secs = server_ceiling(server.endpoint, [f"small/{n}" for n in names])
        rate = nbytes / secs / 1e6
        cap = f" = {rate / (args.rate_mbit / 8):.2f}× the link" if capped else ""
        print(f" ceiling: every object GET once, nothing stored, 128 in flight: {secs:6.1f} s, {rate:7.1f} MB/s, "
              f"{len(names) / secs:7.0f} files/s{cap} (what this server gives any client)")

    for layout, threshold in (("packed", "1MiB"), ("per-file", "0")):
        if "cold" not in args.passes:
            break
        os.environ["CACHEFS_CACHE_PACK_THRESHOLD"] = threshold
        cache = os.path.join(work, f"cache-{layout}")
        t = time.perf_counter()
        subprocess.run([*cli, "prefetch", url, "-q", "--cache-dir", cache], check=True)
        secs = time.perf_counter() - t
        cold[layout] = secs
        rate = nbytes / secs / 1e6
        cap = f" = {rate / (args.rate_mbit / 8):.2f}× the {args.rate_mbit} Mbit/s link" if capped else ""
        print(f"{layout:>8}: cold prefetch {secs:6.1f} s, {rate:7.1f} MB/s, {len(names) / secs:7.0f} files/s{cap}")
        if "warm" not in args.passes:
            continue

        for n in (1, args.readers):
            groups = split(names, n)
            mine, disk, via_fsspec = [], [], []
            mount = cachefs_mount(url, mnt, cache)
            try:
                for _ in range(args.rounds):
                    drop_caches()
                    secs, got = parallel_read(split(local_paths, n))
                    assert got == nbytes
                    disk.append(len(names) / secs)
                    drop_caches()
                    secs, got = parallel_read([[os.path.join(mnt, x) for x in g] for g in groups])
                    assert got == nbytes, (got, nbytes)
                    mine.append(len(names) / secs)
            finally:
                mount.close()
            for _ in range(args.rounds):
                drop_caches()
                secs, got = fsspec_parallel(groups, cache, url)
                assert got == nbytes
                via_fsspec.append(len(names) / secs)
            m, d, f = statistics.median(mine), statistics.median(disk), statistics.median(via_fsspec)
            print(f"{layout:>8}: warm x{n}: mount {m:7.0f} files/s = {m / d:.2f}× local disk ({d:.0f} files/s); "
                  f"fsspec {f:7.0f} files/s = {f / d:.2f}×")
    os.environ.pop("CACHEFS_CACHE_PACK_THRESHOLD", None)
    if "mirror" not in args.passes:
        return

    paths = [os.path.join(mnt, x) for x in names]
    per_file_read = {}
    for n in (1, args.readers):
        secs = per_file_read[n] = cold_read(url, mnt, os.path.join(work, f"cache-read-{n}"), split(paths, n), nbytes)
        print(f"    read: cold x{n} through the mount, no mirror: {secs:6.1f} s, {nbytes / secs / 1e6:7.1f} MB/s, "
              f"{len(names) / secs:7.0f} files/s")

    # Cold through a packed mirror: `cachefs pack` once, then a node with an empty cache prefetches.
    t = time.perf_counter()
    subprocess.run([*cli, "pack", url, "--cache-dir", os.path.join(work, "cache-packer"), "--json"], check=True,
                   stdout=subprocess.DEVNULL)
    print(f"  mirror: cachefs pack {time.perf_counter() - t:6.1f} s")
    t = time.perf_counter()
    subprocess.run([*cli, "prefetch", url, "-q", "--cache-dir", os.path.join(work, "cache-mirror")], check=True)
    secs = time.perf_counter() - t
    rate = nbytes / secs / 1e6
    cap = f" = {rate / (args.rate_mbit / 8):.2f}× the link" if capped else ""
    print(f"  mirror: cold prefetch {secs:6.1f} s, {rate:7.1f} MB/s, {len(names) / secs:7.0f} files/s{cap}"
          + (f"; {cold['packed'] / secs:.1f}× the cold path without a mirror (a GET per file)" if cold else ""))
    for n in (1, args.readers):
        secs = cold_read(url, mnt, os.path.join(work, f"cache-read-mirror-{n}"), split(paths, n), nbytes)
        print(f"    read: cold x{n} through the mount and the mirror: {secs:6.1f} s, {nbytes / secs / 1e6:7.1f} MB/s, "
              f"{len(names) / secs:7.0f} files/s = {per_file_read[n] / secs:.1f}× the same read without a mirror")


def cold_read(url: str, mnt: str, cache: str, groups: list[list[str]], nbytes: int) -> float:
    """Seconds for ``groups`` of readers to read every file through a mount of ``url`` on an empty cache."""
    mount = cachefs_mount(url, mnt, cache)
    try:
        drop_caches()
        secs, got = parallel_read(groups)
        assert got == nbytes, (got, nbytes)
    finally:
        mount.close()
    return secs


if __name__ == "__main__":
    main()

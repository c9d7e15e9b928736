"""FUSE over io_uring against the classic ``/dev/fuse`` read loop, same run, same cache, alternating mounts.

The fuse module's ``enable_uring`` parameter is switched on for the run (root) and restored after. Each round
mounts the same fully cached small-file dataset twice, ``--io-uring auto`` (the kernel hands requests to per-CPU
ring queues) and ``--io-uring off``, and measures, beside the same tree on local disk:

* warm small files, N reader processes, page cache and dentries dropped before every pass (every file reaches
  the daemon: LOOKUP, GETATTR, READ or an open of a packed file);
* ``stat`` of random paths never listed (a fresh mount, dentries dropped): LOOKUP only, N processes;
* the daemon's CPU per file in the first pass;
* the same two passes through our FUSE layer serving the same names and sizes with nothing to find
  (``bench/fuse_floor.py`` ``FileTree``), the bytes in memory (the protocol layer alone), and each file read from
  the local copy (one open and read per file: what a cache without packs would do).

Medians of interleaved rounds.

    python -m bench.uring_bench                  # 5,000 files, 3 rounds
    python -m bench.uring_bench --small 20000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from bench.fuse_bench import cachefs_mount, cpu_seconds, daemon_pid, parallel_read, split
from bench.fuse_floor import files_floor_mount
from bench.read_bench import drop_caches

PARAM = "/sys/module/fuse/parameters/enable_uring"


def _stat_files(paths: list[str], start, done) -> None:
    start.wait()
    t = time.perf_counter()
    for p in paths:
        os.stat(p)
    done.put(time.perf_counter() - t)


def parallel_stat(groups: list[list[str]]) -> float:
    """``stat`` each group of paths in its own process; seconds from start to the last finish."""
    ctx = mp.get_context("fork")
    start, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_stat_files, args=(g, start, done)) for g in groups]
    for p in procs:
        p.start()
    time.sleep(0.2)
    start.set()
    ends = [done.get() for _ in procs]
    for p in procs:
        p.join()
    return max(ends)  # (each process times its own loop: the slowest sets the pace)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=int, default=5_000)
    p.add_argument("--stats", type=int, default=2_000, help="paths stat-ed without a listing, per round")
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if os.geteuid() != 0 or not os.path.exists(PARAM):
        sys.exit("uring_bench needs root and a fuse module with io_uring (Linux 6.14+, CONFIG_FUSE_IO_URING)")
    with open(PARAM) as f:
        before = f.read().strip()
    from cachefs.testing.s3server import S3Server

    work = tempfile.mkdtemp(prefix="cachefs-uringbench-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    server = S3Server(fast=True)
    try:
        with open(PARAM, "w") as f:
            f.write("Y\n")
        server.start()
        run(args, server, work)
    finally:
        with open(PARAM, "w") as f:
            f.write(before + "\n")
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def run(args, server, work: str) -> None:
    os.environ.update(server.env())
    client = server.client()
    client.create_bucket(Bucket="bench")
    rng = random.Random(args.seed)
    small = {f"d{i % 100:03d}/s{i:06d}.jpg": rng.randbytes(rng.randint(4 << 10, 64 << 10)) for i in range(args.small)}
    local, cache, mnt = (os.path.join(work, d) for d in ("local", "cache", "mnt"))
    os.makedirs(mnt)
    for rel, data in small.items():
        path = os.path.join(local, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket="bench", Key=f"small/{kv[0]}", Body=kv[1]), small.items()))
    nbytes = sum(len(d) for d in small.values())
    names = list(small)
    sizes = {n: len(d) for n, d in small.items()}
    del small
    subprocess.run([sys.executable, "-m", "cachefs.cli.main", "prefetch", "s3://bench/small", "-q", "--cache-dir",
                    cache], check=True)
    random.Random(args.seed).shuffle(names)
    stat_names = random.Random(args.seed + 1).sample(names, min(args.stats, len(names)))
    print(f"# {len(names)} small files (4-64 KiB, {nbytes / 2**20:.0f} MiB) fully cached; {args.readers} reader "
          f"processes; {os.cpu_count()} CPUs; kernel {os.uname().release}")

    def read_pass(root: str) -> float:
        drop_caches()
        secs, got = parallel_read(split([os.path.join(root, n) for n in names], args.readers))
        assert got == nbytes, (got, nbytes)
        return len(names) / secs

    def stat_pass(root: str) -> float:
        drop_caches()
        return len(stat_names) / parallel_stat(split([os.path.join(root, n) for n in stat_names], args.readers))

    rows: dict[str, dict[str, list[float]]] = {k: {"read": [], "stat": [], "cpu": []}
                                               for k in ("auto", "off", "local", "floor", "floor_disk")}
    for _ in range(args.rounds):
        for floor, source in (("floor", ""), ("floor_disk", local)):  # our FUSE layer, nothing to find (fuse_floor)
            for what in ("stat", "read"):
                mount = files_floor_mount(mnt, sizes, work, source=source)
                try:
                    rows[floor][what].append(stat_pass(mnt) if what == "stat" else read_pass(mnt))
                finally:
                    mount.close()
        for mode in ("auto", "off"):
            for what in ("stat", "read"):  # a fresh mount for each: the stat pass must find nothing listed
                mount = cachefs_mount("s3://bench/small", mnt, cache, "--io-uring", mode)
                try:
                    pid = daemon_pid(cache, mnt)
                    uring = ring_queues(cache, mnt)
                    assert bool(uring) == (mode == "auto"), f"--io-uring {mode}: {uring} ring queues"
                    if what == "stat":
                        rows[mode]["stat"].append(stat_pass(mnt))
                    else:
                        cpu0 = cpu_seconds(pid)
                        rows[mode]["read"].append(read_pass(mnt))
                        rows[mode]["cpu"].append((cpu_seconds(pid) - cpu0) / len(names) * 1e6)
                finally:
                    mount.close()
        rows["local"]["stat"].append(stat_pass(os.path.join(local)))
        rows["local"]["read"].append(read_pass(os.path.join(local)))
    med = {k: {m: statistics.median(v) for m, v in r.items() if v} for k, r in rows.items()}
    loc = med["local"]
    for mode, label in (("auto", "io_uring"), ("off", "/dev/fuse")):
        m = med[mode]
        print(f"{label:>9}: warm small files x{args.readers}, page cache dropped {m['read']:8.0f} files/s "
              f"= {m['read'] / loc['read']:.2f}x local ({loc['read']:.0f}); stat never listed {m['stat']:8.0f}/s "
              f"= {m['stat'] / loc['stat']:.2f}x local ({loc['stat']:.0f}); daemon CPU {m['cpu']:.0f} us/file")
    for floor, label in (("floor", "bytes in memory"), ("floor_disk", "each file read from the local copy")):
        f = med[floor]
        print(f"    floor, our FUSE layer with {label}: warm small files {f['read']:8.0f} files/s = "
              f"{f['read'] / loc['read']:.2f}x local; stat never listed {f['stat']:8.0f}/s = "
              f"{f['stat'] / loc['stat']:.2f}x local; /dev/fuse is {med['off']['read'] / f['read']:.2f}x of it for "
              f"reads, {med['off']['stat'] / f['stat']:.2f}x for stat")
    a, o = med["auto"], med["off"]
    print(f"io_uring / /dev/fuse: reads {a['read'] / o['read']:.2f}x, stat {a['stat'] / o['stat']:.2f}x, "
          f"daemon CPU per file {a['cpu'] / o['cpu']:.2f}x")


def ring_queues(cache: str, mnt: str) -> int:
    """The io_uring queues the mount's daemon serves (0: /dev/fuse only), from its mount record."""
    from cachefs.index.mounts import list_mounts

    deadline = time.monotonic() + 10
    while True:
        rec = next((r for r in list_mounts(cache) if r["mountpoint"] == mnt), {})
        n = int((rec.get("stats") or {}).get("io_uring_queues", 0))
        if n or time.monotonic() > deadline or rec.get("mode") not in (None, "starting"):
            return n
        time.sleep(0.05)


if __name__ == "__main__":
    main()

"""Datasets of 10^5–10^7 objects through the mount (root: FUSE), against a synthetic S3 endpoint that computes
its objects instead of storing them (:mod:`cachefs.testing.synthetic_s3`: directories of 1,000 objects of
1–64 KiB), and rclone's mount of the same endpoint, in one run.

Printed per size N, for cachefs and rclone alike where it applies:

* **mount ready**: from starting the mount command until ``ls`` of the root answers (``--foreground``, and as
  users run it, in the background: until the command returned and ``ls`` answered);
* **first byte**: then, reading one byte of a file never looked up;
* **walk cold / warm**: ``os.walk`` plus a ``stat`` of every file (what torchvision's ImageFolder does), twice;
* **stat without listing**: ``stat`` of random paths on a fresh mount of a cache that holds the manifest, then a
  walk + stat of the whole tree there (the kernel's caches cold, the manifest local: what a job's loader does at
  its start on a node that listed the dataset before);
* **memory**: resident memory of the mount's processes (the daemon and its holder) after the walk, and per object;
* **manifest on disk** (cachefs): the index's bytes per object, and the listing's keys/s (``cachefs refresh``).

Every byte read is checked against the key's content. Same-run yardstick: ``os.walk`` + ``stat`` of a local tree
of the same shape (empty files) where N ≤ ``--local-max``.

    python -m bench.scale_bench                       # N = 10^5 and 10^6
    python -m bench.scale_bench --sizes 10000000      # 10^7 (minutes; memory as it grows)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from bench.fuse_bench import Mount, rclone_mount

CLI = [sys.executable, "-m", "cachefs.cli.main"]
CREDS = {"AWS_ACCESS_KEY_ID": "synthetic", "AWS_SECRET_ACCESS_KEY": "synthetic", "AWS_REGION": "us-east-1"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100000,1000000")
    p.add_argument("--stats", type=int, default=20000,
                   help="paths stat'ed without a listing, by ours and by the floor (2,000 took 40 ms: noise)")
    p.add_argument("--local-max", type=int, default=1_000_000)
    p.add_argument("--systems", default="cachefs,rclone")
    p.add_argument("--rclone-max", type=int, default=200_000, help="the largest N rclone is measured at (its cold "
                   "walk lists each directory on the way: minutes at 10^6)")
    p.add_argument("--flat", type=int, default=0, help="instead: one flat directory of this many objects (ls cold, "
                   "then a stat of every file)")
    p.add_argument("--listing-only", action="store_true", help="instead: only the listing (cachefs refresh) and the "
                   "manifest on disk, for each size (10^8 takes minutes and ~15 GB of cache disk)")
    args = p.parse_args()
    if args.flat:
        run_flat(args.flat)
        return
    systems = [s for s in args.systems.split(",") if s != "rclone" or shutil.which("rclone")]
    for n in (int(x) for x in args.sizes.split(",")):
        if args.listing_only:
            run_listing(n)
        else:
            run_size(n, args, systems)


class SyntheticServer:
    def __init__(self, objects: int, flat: int = 0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "cachefs.testing.synthetic_s3", "--objects", str(objects),
                                      "--flat", str(flat)], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError("the synthetic S3 server did not start")
        self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of ``pid`` and every process under it: in all, and of them anonymous (the rest is mapped
    files: the index's and the inode table's pages, which are the page cache's and go back under pressure)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except OSError:
                continue
    total = anon = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        stack.extend(children.get(p, ()))
        try:
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if "VmRSS" in fields:
            total += int(fields["VmRSS"].split()[0]) * 1024
            anon += int(fields["RssAnon"].split()[0]) * 1024
    return total, anon


def run_flat(n: int) -> None:
    """One directory of ``n`` objects (``flat/``): ``ls`` of it cold (the directory listed on demand while the
    manifest is taken beside it), a stat of every file, a read of one, the memory after (and at mount ready)."""
    server = SyntheticServer(1, flat=n)
    work = tempfile.mkdtemp(prefix="cachefs-scale-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, **CREDS})
    print(f"# one flat directory of {n:,} objects; synthetic S3 on loopback; {os.cpu_count()} CPUs")
    try:
        mnt, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
        t = time.perf_counter()
        mount, root = _mount("cachefs", server, mnt, cache)
        try:
            os.listdir(root)
            ready = time.perf_counter() - t
            _, anon_ready = tree_rss(mount.proc.pid)
            t = time.perf_counter()
            names = os.listdir(os.path.join(root, "flat"))
            listed = time.perf_counter() - t
            t = time.perf_counter()
            for name in names:
                os.stat(os.path.join(root, "flat", name))
            stat_secs = time.perf_counter() - t
            check(os.path.join(root, "flat", names[len(names) // 2]), f"flat/{names[len(names) // 2]}")
            rss, anon = tree_rss(mount.proc.pid)
        finally:
            mount.close()
        assert len(names) == n, (len(names), n)
        print(f"  cachefs: mount ready {ready:.2f} s; ls of flat/ cold {listed:.1f} s ({n / listed:,.0f} entries/s); "
              f"stat of every file {stat_secs:.1f} s ({n / stat_secs:,.0f}/s); memory after {rss / 2**20:,.0f} MiB, "
              f"of it anonymous {anon / 2**20:,.0f} MiB ({anon / n:,.0f} B per object; "
              f"{(anon - anon_ready) / n:,.0f} B per object more than at mount ready, {anon_ready / 2**20:,.0f} MiB)")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def run_listing(n: int) -> None:
    """Only ``cachefs refresh`` of ``n`` objects into a fresh cache: keys/s and the manifest's bytes on disk."""
    server = SyntheticServer(n)
    work = tempfile.mkdtemp(prefix="cachefs-scale-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, **CREDS})
    try:
        cache = os.path.join(work, "cache")
        t = time.perf_counter()
        subprocess.run([*CLI, "refresh", "s3://synthetic", "--cache-dir", cache], check=True, stdout=subprocess.DEVNULL)
        secs = time.perf_counter() - t
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs if f.endswith(".mdb"))
        in_use = manifest_pages(os.path.join(cache, "index"))
        print(f"# N = {n:,}: listing (cachefs refresh) {secs:6.1f} s = {n / secs:,.0f} keys/s; index on disk "
              f"{size / 2**20:,.0f} MiB ({size / n:.0f} B per object), the manifest's pages in use {in_use / n:.0f} B "
              "per object")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def floor_rates(bucket, keys: list[str], mnt: str) -> tuple[float, float]:
    """(stat of ``keys`` never listed per second, walk + stat files per second) through bench.fuse_floor's
    arithmetic tree of ``bucket``'s shape, each on a fresh mount."""
    from bench.fuse_floor import floor_mount

    os.makedirs(mnt, exist_ok=True)
    m = floor_mount(mnt, bucket.dirs, bucket.per_dir)
    try:
        t = time.perf_counter()
        for k in keys:
            os.stat(os.path.join(mnt, k))
        stat_rate = len(keys) / (time.perf_counter() - t)
    finally:
        m.close()
    m = floor_mount(mnt, bucket.dirs, bucket.per_dir)
    try:
        t = time.perf_counter()
        n = walk(mnt)
        walk_rate = n / (time.perf_counter() - t)
    finally:
        m.close()
    return stat_rate, walk_rate


def walk(root: str) -> int:
    n = 0
    for d, _, files in os.walk(root):
        for name in files:
            os.stat(os.path.join(d, name))
            n += 1
    return n


def check(path: str, key: str) -> None:
    from cachefs.testing.synthetic_s3 import SyntheticBucket, content

    name = key.rpartition("/")[2]  # (f0000000042.bin: the object's number, in a directory or in flat/)
    number = int(name[1:11]) if name.startswith("f") and name[1:11].isdigit() else None
    with open(path, "rb") as f:
        data = f.read()
    assert number is not None and data == content(number, 0, SyntheticBucket.size(number)), key


def run_size(n: int, args, systems: list[str]) -> None:
    from cachefs.testing.synthetic_s3 import SyntheticBucket

    bucket = SyntheticBucket(n)
    rng = random.Random(n)
    server = SyntheticServer(n)
    work = tempfile.mkdtemp(prefix="cachefs-scale-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, **CREDS})
    print(f"# N = {n:,} objects in {bucket.dirs:,} directories of {bucket.per_dir}; synthetic S3 on loopback; "
          f"{os.cpu_count()} CPUs")
    try:
        if n <= args.local_max:
            local = os.path.join(work, "local")
            for d in range(bucket.dirs):
                os.makedirs(os.path.join(local, f"d{d:06d}"))
            for i in range(n):
                open(os.path.join(local, bucket.key(i)), "wb").close()
            t = time.perf_counter()
            assert walk(local) == n
            secs = time.perf_counter() - t
            print(f"  local tree: walk + stat {secs:6.2f} s ({n / secs:,.0f} files/s)")
            shutil.rmtree(local)
        for system in systems:
            if system == "rclone" and n > args.rclone_max:
                print(f"   rclone: not measured above --rclone-max {args.rclone_max:,}")
                continue
            measure(system, n, bucket, rng, server, work, args)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _mount(system: str, server: SyntheticServer, mnt: str, cache: str) -> tuple[Mount, str]:
    os.makedirs(mnt, exist_ok=True)
    if system == "cachefs":
        return Mount([*CLI, "mount", "s3://synthetic", mnt, "--foreground", "--cache-dir", cache], mnt), mnt
    return rclone_mount(server.endpoint, mnt, cache, CREDS, os.path.dirname(mnt), bucket="synthetic"), mnt


def measure(system: str, n: int, bucket, rng: random.Random, server: SyntheticServer, work: str, args) -> None:
    mnt, cache = os.path.join(work, f"mnt-{system}"), os.path.join(work, f"cache-{system}")
    t = time.perf_counter()
    mount, root = _mount(system, server, mnt, cache)
    try:
        os.listdir(root)
        ready = time.perf_counter() - t
        key = bucket.key(rng.randrange(n))
        t = time.perf_counter()
        with open(os.path.join(root, key), "rb") as f:
            f.read(1)
        first = time.perf_counter() - t
        check(os.path.join(root, key), key)
        t = time.perf_counter()
        walked = walk(root)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        walk(root)
        warm = time.perf_counter() - t
        rss, anon = tree_rss(mount.proc.pid)
    finally:
        mount.close()
    assert walked == n, (walked, n)
    print(f"  {system:>7}: mount ready {ready:6.2f} s, first byte {first * 1000:6.1f} ms, walk + stat cold {cold:6.1f} s "
          f"({n / cold:,.0f} files/s), warm {warm:6.1f} s; memory after the walk {rss / 2**20:,.0f} MiB "
          f"({rss / n:,.0f} B per object), of it anonymous {anon / 2**20:,.0f} MiB ({anon / n:,.0f} B per object)")
    mount, root = _mount(system, server, mnt, cache)  # the cache holds the listing now
    try:
        os.listdir(root)
        keys = [bucket.key(rng.randrange(n)) for _ in range(args.stats)]
        t = time.perf_counter()
        for k in keys:
            os.stat(os.path.join(root, k))
        secs = time.perf_counter() - t
        for k in keys[:20]:
            check(os.path.join(root, k), k)
        t = time.perf_counter()
        walked = walk(root)
        local = time.perf_counter() - t
    finally:
        mount.close()
    assert walked == n, (walked, n)
    print(f"  {system:>7}: stat of {args.stats} paths never listed, fresh mount: {args.stats / secs:,.0f} stats/s; "
          f"then walk + stat with the listing local {local:6.1f} s ({n / local:,.0f} files/s)")
    if system == "cachefs":  # the bound: the same requests answered by our FUSE layer from arithmetic alone
        floor_stat, floor_walk = floor_rates(bucket, keys, mnt + "-floor")
        print(f"  {system:>7}: the same through our FUSE layer answering from arithmetic (bench/fuse_floor.py, no "
              f"manifest): stat never listed {floor_stat:,.0f}/s (ours {args.stats / secs / floor_stat:.2f}x of it), "
              f"walk + stat {floor_walk:,.0f} files/s (ours with the listing local {n / local / floor_walk:.2f}x)")
    if system == "cachefs":
        # `cachefs mount` as users run it (in the background; it returns once the mount serves), on a fresh cache
        fresh = os.path.join(work, "cache-background")
        t = time.perf_counter()
        subprocess.run([*CLI, "mount", "s3://synthetic", mnt, "--cache-dir", fresh], check=True,
                       stdout=subprocess.DEVNULL)
        os.listdir(mnt)
        background = time.perf_counter() - t
        subprocess.run([*CLI, "umount", mnt, "--cache-dir", fresh], check=True, stdout=subprocess.DEVNULL)
        print(f"  {system:>7}: mount ready in the background (the CLI's default; until `cachefs mount` returned and "
              f"`ls` answered), fresh cache: {background:.2f} s")
        t = time.perf_counter()
        subprocess.run([*CLI, "refresh", "s3://synthetic", "--cache-dir", cache], check=True,
                       stdout=subprocess.DEVNULL)
        secs = time.perf_counter() - t
        index = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs
                    if f.endswith(".mdb"))
        used = manifest_pages(os.path.join(cache, "index"))
        print(f"  {system:>7}: listing (cachefs refresh) {secs:6.1f} s = {n / secs:,.0f} keys/s; index on disk "
              f"{index / 2**20:,.0f} MiB for two manifest versions ({index / n / 2:,.0f} B per object per version), "
              f"of it the manifests' pages in use {used / 2**20:,.0f} MiB ({used / n / 2:,.0f} B per object per "
              f"version; the rest is free pages a provisional tree left, reused by later writes)")


def manifest_pages(index_dir: str) -> int:
    """Bytes of the pages the index's manifest table uses (its B-tree), free pages of the file not counted."""
    import lmdb

    env = lmdb.open(index_dir, readonly=True, lock=False, max_dbs=32)
    try:
        with env.begin() as txn:
            st = txn.stat(env.open_db(b"manifest", txn=txn, create=False))
        return (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"]
    finally:
        env.close()


if __name__ == "__main__":
    main()

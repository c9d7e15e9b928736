"""Reading through the mount when the cache disk is far too small: the reader must still get the origin's speed.

A file several times larger than the cache disk (a tmpfs of ``--disk-mib``) is read sequentially through
``cachefs mount``, with the page cache dropped, against the same origin read by a plain client in the same run:
one streaming GET of the whole object through botocore (what ``aws s3 cp`` to /dev/null does). Rounds are
interleaved. Target (docs/SEMANTICS.md, "Full disks"): at least half the origin's rate.

    python -m bench.full_disk_bench                       # 256 MiB file, 64 MiB cache disk, 1 Gbit/s + 10 ms origin
    python -m bench.full_disk_bench --file-mib 128 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.read_bench import drop_caches, origin_on_link

CHUNK = 1 << 20


def read_file(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while b := f.read(CHUNK):
            n += len(b)
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file-mib", type=int, default=256)
    p.add_argument("--disk-mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate-mbit", type=int, default=1000)
    p.add_argument("--delay-ms", type=float, default=10.0)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("full_disk_bench: needs root (a tmpfs cache disk and a FUSE mount)")
    with origin_on_link(args.rate_mbit, args.delay_ms) as (server, work, capped):
        run(args, server, work, capped)


def run(args, server, work: str, capped: bool) -> None:
    from cachefs.fuse.mount import unmount
    from cachefs.index.mounts import list_mounts

    os.environ.update(server.env())
    client = server.client()
    client.create_bucket(Bucket="bench")
    size = args.file_mib << 20
    client.put_object(Bucket="bench", Key="ds/big.bin", Body=os.urandom(size))
    link = f"{args.rate_mbit} Mbit/s tbf" if capped else "loopback, no cap"
    print(f"# origin: moto S3, +{args.delay_ms:g} ms per request, {link}; one {args.file_mib} MiB file; "
          f"cache on a {args.disk_mib} MiB tmpfs")

    disk = os.path.join(work, "disk")
    mnt = os.path.join(work, "mnt")
    os.makedirs(disk)
    os.makedirs(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.disk_mib}m", "tmpfs", disk], check=True)
    cache = os.path.join(disk, "cache")
    holder = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "mount", "--foreground", "s3://bench/ds",
                               mnt, "--cache-dir", cache], env={**os.environ, "CACHEFS_CACHE_LOG_DIR": work},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not any(m["mountpoint"] == mnt and m["pid"] for m in list_mounts(cache)):
            if time.monotonic() > deadline or holder.poll() is not None:
                sys.exit("full_disk_bench: the mount did not come up")
            time.sleep(0.1)

        def origin() -> float:
            t = time.perf_counter()
            body = client.get_object(Bucket="bench", Key="ds/big.bin")["Body"]
            n = 0
            while b := body.read(CHUNK):
                n += len(b)
            assert n == size
            return size / (time.perf_counter() - t) / 1e6

        def mount() -> float:
            drop_caches()
            t = time.perf_counter()
            assert read_file(os.path.join(mnt, "big.bin")) == size
            return size / (time.perf_counter() - t) / 1e6

        rates: dict[str, list[float]] = {"origin": [], "mount": []}
        for r in range(args.rounds):
            for name, fn in (("origin", origin), ("mount", mount)) if r % 2 == 0 else (("mount", mount),
                                                                                       ("origin", origin)):
                rates[name].append(fn())
        st = os.statvfs(disk)
        free = st.f_bavail * st.f_frsize
    finally:
        try:
            unmount(mnt)
        finally:
            holder.wait(30)
            subprocess.run(["umount", "-l", disk], check=False)
    o, m = statistics.median(rates["origin"]), statistics.median(rates["mount"])

    def rounds(name: str) -> str:
        return ", ".join(f"{x:.0f}" for x in rates[name])

    print(f"origin (one streaming GET, nothing stored)  {o:7.1f} MB/s   rounds {rounds('origin')}")
    print(f"mount, cache disk {args.disk_mib} MiB (full)          {m:7.1f} MB/s   rounds {rounds('mount')}")
    print(f"cache disk free after the reads: {free / 2**20:.1f} MiB")
    ok = "meets" if m / o >= 0.5 else "BELOW"
    print(f"RESULT full disk read through the mount vs the origin: {m / o:.2f}x (target >= 0.5x: {ok})")


if __name__ == "__main__":
    tempfile.tempdir = os.environ.get("CACHEFS_BENCH_DIR") or None
    main()

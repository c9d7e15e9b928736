"""Read-path benchmark: cachefs against fsspec's own doors and plain local reads, measured in one run.

The origin is moto's S3 server with a per-request delay (default 10 ms) standing in for object-storage
latency. As root, the server runs in a network namespace made for the run, behind a veth pair whose both
ends are capped with ``tc tbf`` (default 1 Gbit/s), so "the link" is real; otherwise it runs on loopback
without a cap (printed). Every figure is printed as a ratio to a baseline measured in the same run.

    python -m bench.read_bench                       # the issue's sizes: 3 × 256 MiB, 20,000 small files
    python -m bench.read_bench --large 2 --large-mib 64 --small 4000   # a quicker pass
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import fsspec

NS, HOST_IF, NS_IF = "cfsbench", "cfsb0", "cfsb1"
HOST_IP, NS_IP = "192.168.237.1", "192.168.237.2"  # inside the namespace this run creates, nowhere else


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def make_link(rate_mbit: int) -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    teardown_link()
    try:
        sh("ip", "netns", "add", NS)
        sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        sh("ip", "link", "set", NS_IF, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        sh("ip", "link", "set", HOST_IF, "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "1mb", "latency", "100ms"]
        sh("tc", "qdisc", "add", "dev", HOST_IF, "root", *tbf)
        sh("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", NS_IF, "root", *tbf)
        return True
    except subprocess.CalledProcessError as exc:
        print(f"# no capped link ({exc.stderr.strip()}); using loopback", file=sys.stderr)
        teardown_link()
        return False


def teardown_link() -> None:
    sh("ip", "link", "del", HOST_IF, check=False)
    sh("ip", "netns", "del", NS, check=False)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--large", type=int, default=3)
    p.add_argument("--large-mib", type=int, default=256)
    p.add_argument("--small", type=int, default=20_000)
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--rate-mbit", type=int, default=1000)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--moto-get", action="store_true", help="serve GETs through moto itself (slow per request)")
    args = p.parse_args()

    with origin_on_link(args.rate_mbit, args.delay_ms, fast=not args.moto_get) as (server, work, capped):
        run(args, server, work, capped)


@contextmanager
def origin_on_link(rate_mbit: int, delay_ms: float, *, fast: bool = True):
    """(moto S3 server with ``delay_ms`` per request behind a ``rate_mbit`` link when root allows it, a work
    directory, whether the link is capped); everything is torn down afterwards."""
    from cachefs.testing.s3server import S3Server

    capped = make_link(rate_mbit)
    work = tempfile.mkdtemp(prefix="cachefs-bench-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    server = S3Server(host=NS_IP if capped else "127.0.0.1", delay_ms=delay_ms, netns=NS if capped else None,
                      fast=fast)
    try:
        server.start()
        yield server, work, capped
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        if capped:
            teardown_link()


def run(args, server, work: str, capped: bool) -> None:
    rng = random.Random(args.seed)
    os.environ.update(server.env())
    client = server.client()
    bucket = "bench"
    client.create_bucket(Bucket=bucket)
    large = {f"large/part-{i}.bin": os.urandom(args.large_mib << 20) for i in range(args.large)}
    small = {f"small/c{i % 100:03d}/f{i:06d}.bin": rng.randbytes(rng.randint(4096, 64 * 1024))
             for i in range(args.small)}
    t = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=f"ds/{kv[0]}", Body=kv[1]),
                      [*large.items(), *small.items()]))
    link = f"{args.rate_mbit} Mbit/s tbf on a veth into netns {NS}" if capped else "loopback, no bandwidth cap"
    print(f"# origin: moto S3 at {server.endpoint}, +{args.delay_ms:g} ms per request, {link}; "
          f"uploaded {len(large)} × {args.large_mib} MiB + {len(small)} small files in {time.perf_counter() - t:.1f}s")
    large_bytes = sum(map(len, large.values()))
    small_bytes = sum(map(len, small.values()))
    results = []
    ds_url = f"s3://{bucket}/ds"

    def fs_for(door: str, cache: str):
        if door == "s3":
            return fsspec.filesystem("s3", skip_instance_cache=True)
        if door == "cachefs":
            return fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache, dataset=ds_url,
                                     skip_instance_cache=True)
        return fsspec.filesystem(door, target_protocol="s3", cache_storage=cache, skip_instance_cache=True)

    # 0. the manifest: one parallel listing per dataset and node, taken before the data passes below so that
    # they compare data paths (the other doors HEAD each object instead, inside their timings)
    for name in ("cold-cachefs", "prefetch", "small-cachefs"):
        fs = fs_for("cachefs", os.path.join(work, name))
        t = time.perf_counter()
        fs._open_dataset(ds_url)
        print(f"manifest    {len(large) + len(small)} objects listed in {time.perf_counter() - t:.2f}s ({name})")

    # 1. cold large objects
    cold = {}
    for door in ("s3", "filecache", "simplecache", "cachefs"):
        cache = os.path.join(work, f"cold-{door}")
        fs = fs_for(door, cache)

        def read_all(fs=fs):
            for k in large:
                with fs.open(f"{bucket}/ds/{k}", "rb") as f:
                    assert len(f.read()) == len(large[k])

        cold[door] = large_bytes / timed(read_all) / 1e6
        print(f"cold large  {door:12s} {cold[door]:8.1f} MB/s")
    best = max(v for k, v in cold.items() if k != "cachefs")
    results.append(("cold large: cachefs vs best of s3/filecache/simplecache", cold["cachefs"] / best, 1.5))
    if capped:
        results.append(("cold large: cachefs vs link capacity", cold["cachefs"] / (args.rate_mbit / 8), None))

    # 2. warm large, page cache dropped, vs a plain local copy
    local_dir = os.path.join(work, "local")
    for k, v in large.items():
        os.makedirs(os.path.dirname(os.path.join(local_dir, k)), exist_ok=True)
        with open(os.path.join(local_dir, k), "wb") as f:
            f.write(v)
    fs = fs_for("cachefs", os.path.join(work, "cold-cachefs"))
    warm, local = [], []
    for _ in range(3):
        dropped = drop_caches()

        def read_cachefs():
            for k in large:
                with fs.open(f"{bucket}/ds/{k}", "rb") as f:
                    f.read()

        warm.append(large_bytes / timed(read_cachefs) / 1e6)
        drop_caches()

        def read_local():
            for k in large:
                with open(os.path.join(local_dir, k), "rb") as f:
                    f.read()

        local.append(large_bytes / timed(read_local) / 1e6)
    w, l_ = sorted(warm)[1], sorted(local)[1]
    print(f"warm large  cachefs {w:8.1f} MB/s   local copy {l_:8.1f} MB/s   (median of 3; page cache "
          f"{'dropped' if dropped else 'NOT dropped (not root)'})")
    results.append(("warm large: cachefs vs plain local read", w / l_, 0.95))

    # 3. prefetch of the small tree vs the link, and vs the most this client stack and server can do at all:
    # bare GETs of the same objects through the same (retrying) source, 128 in flight, nothing stored
    import asyncio

    from cachefs.base.aio import run_sync
    from cachefs.jobs import warm as warm_up

    fs = fs_for("cachefs", os.path.join(work, "prefetch"))
    ds = fs._open_dataset(ds_url)
    entries = [e for e in ds.walk_files() if e.path.startswith("small/")]

    async def bare_gets():
        sem = asyncio.Semaphore(128)

        async def get(e):
            async with sem:
                await ds.source.read(ds.ref.object_url(e.path), e.version, 0, e.size)

        await asyncio.gather(*(get(e) for e in entries))

    t = time.perf_counter()
    run_sync(bare_gets())
    ceiling = small_bytes / (time.perf_counter() - t) / 1e6
    t = time.perf_counter()
    prog = run_sync(warm_up(fs.engine, ds, include=["small/*"], workers=128))
    elapsed = time.perf_counter() - t
    rate = prog.bytes_fetched / elapsed / 1e6
    print(f"prefetch    {len(small)} small files, {small_bytes / 1e6:.0f} MB in {elapsed:.1f}s = {rate:.1f} MB/s, "
          f"{len(small) / elapsed:.0f} files/s; bare GETs (nothing stored) {ceiling:.1f} MB/s")
    if capped:
        results.append(("prefetch small tree vs link capacity", rate / (args.rate_mbit / 8), 0.8))
    results.append(("prefetch small tree vs bare GETs of the same objects", rate / ceiling, None))

    # 4. small files, N readers, seeded random order, warm: cachefs vs simplecache
    order = sorted(small)
    random.Random(args.seed).shuffle(order)

    def files_per_s(fs) -> float:
        chunks = [order[i :: args.readers] for i in range(args.readers)]

        def reader(names):
            for k in names:
                with fs.open(f"{bucket}/ds/{k}", "rb") as f:
                    f.read()

        t = time.perf_counter()
        with ThreadPoolExecutor(args.readers) as pool:
            list(pool.map(reader, chunks))
        return len(order) / (time.perf_counter() - t)

    sc = fs_for("simplecache", os.path.join(work, "small-simplecache"))
    sc_cold = files_per_s(sc)
    sc_warm = files_per_s(sc)
    cf = fs_for("cachefs", os.path.join(work, "small-cachefs"))
    cf_cold = files_per_s(cf)
    cf_warm = files_per_s(cf)
    print(f"small x{args.readers}    cachefs cold {cf_cold:8.0f} warm {cf_warm:8.0f} files/s   "
          f"simplecache cold {sc_cold:8.0f} warm {sc_warm:8.0f} files/s")
    results.append((f"small files x{args.readers} warm: cachefs vs simplecache", cf_warm / sc_warm, 1.0))
    results.append((f"small files x{args.readers} cold: cachefs vs simplecache", cf_cold / sc_cold, None))

    # 5. walk + stat of the small tree, warm, vs a local tree
    tree = os.path.join(work, "tree")
    for k in small:
        path = os.path.join(tree, k)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()

    def walk_cachefs():
        n = 0
        for root, _dirs, names in cf.walk(f"{bucket}/ds/small"):
            for name in names:
                cf.info(f"{root}/{name}")
                n += 1
        assert n == len(small)

    def walk_local():
        n = 0
        for root, _dirs, names in os.walk(os.path.join(tree, "small")):
            for name in names:
                os.stat(os.path.join(root, name))
                n += 1
        assert n == len(small)

    walk_cachefs()
    wc, wl = timed(walk_cachefs), timed(walk_local)
    print(f"walk+stat   cachefs {len(small) / wc:8.0f} entries/s   local {len(small) / wl:8.0f} entries/s")
    results.append(("walk + stat warm: cachefs vs local tree", wl / wc, 0.5))

    print("\n| measure | ratio | target |\n|---|---|---|")
    for name, ratio, target in results:
        verdict = "" if target is None else (" (met)" if ratio >= target else " (NOT met)")
        print(f"| {name} | {ratio:.2f}× | {'report' if target is None else f'≥ {target}×'}{verdict} |")



def server_ceiling(endpoint: str, keys: list[str] | list[tuple[str, int, int]], in_flight: int = 128,
                   store=None) -> float:
    """Seconds for a bare aiohttp client (no signing, nothing kept) to GET every key (or ``(key, start, end)``
    byte range) once: the most this server gives any client on this machine, the yardstick beside the link.
    ``store(item, body)``, if given, is run on a worker thread for every body (a bare caching client)."""
    import asyncio

    import aiohttp

    async def go() -> float:
        todo = iter(keys)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=in_flight)) as session:
            async def worker() -> None:
                for item in todo:
                    key, headers = (item, {}) if isinstance(item, str) else (
                        item[0], {"Range": f"bytes={item[1]}-{item[2] - 1}"})
                    async with session.get(f"{endpoint}/bench/{key}", headers=headers) as resp:
                        assert resp.status in (200, 206), resp.status
                        body = await resp.read()
                    if store is not None:
                        await asyncio.to_thread(store, item, body)

            t = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(in_flight)))
            return time.perf_counter() - t

    return asyncio.run(go())

if __name__ == "__main__":
    main()

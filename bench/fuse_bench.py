"""FUSE mount benchmark: reads through ``cachefs mount`` against plain local reads of the same bytes, and
small files against rclone (``mount --vfs-cache-mode full``) and s3fs-fuse on the same S3 server, in one run.

Passes (readers are separate processes, so the clients never share a GIL with each other):

* large files, fully cached, page cache dropped before every pass: the mount (passthrough) vs a raw read of
  the cache's own local files; 1 reader over all files and N readers on N files;
* the same through the userspace path (``--no-passthrough``), and with only the first half of every file
  cached (the rest comes from the origin) vs a raw read of a local copy, beside two yardsticks of what this
  machine allows: the missing halves by bare ranged GETs (nothing stored), and a bare caching client (those
  GETs written into sparse copies while the cached halves are read);
* small files (4–64 KiB), warm, 8 readers in a seeded random order: files/s through the mount vs the same
  tree on local disk, and vs rclone and s3fs when installed (Debian packages rclone, s3fs);
* the daemon's CPU per small file, with the page cache warm and with it dropped (every request answered);
* the daemon's peak RSS during the small-file pass, against the configured memory budget.

Ratios are medians of interleaved rounds (mount and baseline alternate), so machine noise hits both.

    python -m bench.fuse_bench                                 # 4 × 256 MiB, 20,000 small files
    python -m bench.fuse_bench --large-mib 64 --small 4000     # quicker
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
import threading
import time

from bench.read_bench import drop_caches, server_ceiling

CHUNK = 1 << 20


# -- readers (child processes) --------------------------------------------------------------------------------
def _read_files(paths: list[str], start: mp.Event, done: mp.Queue) -> None:
    start.wait()
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                b = f.read(CHUNK)
                if not b:
                    break
                n += len(b)
    done.put((time.perf_counter(), n))


def parallel_read(groups: list[list[str]]) -> tuple[float, int]:
    """Read each group of files in its own process; (seconds from start to the last finish, bytes)."""
    ctx = mp.get_context("fork")
    start, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_read_files, args=(g, start, done)) for g in groups]
    for p in procs:
        p.start()
    time.sleep(0.2)  # let every reader reach the start line
    t0 = time.perf_counter()
    start.set()
    results = [done.get() for _ in procs]
    for p in procs:
        p.join()
    return max(t for t, _ in results) - t0, sum(n for _, n in results)


def bare_caching_client(endpoint: str, ranges: list[tuple[str, int, int]], originals: list[str], work: str,
                        in_flight: int) -> float:
    """Seconds for the least a caching client must do to read half-cached files: the missing ``ranges`` GET by a
    bare aiohttp client (``in_flight`` at once, as in the server ceiling) and written into sparse copies of
    ``originals`` holding the rest, while another thread reads that rest from disk (page cache dropped first).
    No checksums, no index, no FUSE, and every missing range asked for at once: the yardstick for the
    half-cached pass on this machine."""
    os.makedirs(work, exist_ok=True)
    fds, cached = {}, []
    for src in originals:
        size, key = os.path.getsize(src), f"large/{os.path.basename(src)}"
        lo = min((a for k, a, _ in ranges if k == key), default=size)
        path = os.path.join(work, os.path.basename(src))
        with open(src, "rb") as fin, open(path, "wb") as fout:
            fout.write(fin.read(lo))
            fout.truncate(size)
        fds[key] = os.open(path, os.O_RDWR)
        cached.append((fds[key], lo))
    drop_caches()

    def read_cached() -> None:
        for fd, lo in cached:
            for off in range(0, lo, CHUNK):
                os.pread(fd, min(CHUNK, lo - off), off)

    try:
        t = time.perf_counter()
        reader = threading.Thread(target=read_cached)
        reader.start()
        server_ceiling(endpoint, ranges, in_flight, store=lambda item, body: os.pwrite(fds[item[0]], body, item[1]))
        reader.join()
        return time.perf_counter() - t
    finally:
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)


def split(paths: list[str], n: int) -> list[list[str]]:
    return [paths[i::n] for i in range(n)]


# -- mounts ---------------------------------------------------------------------------------------------------
class Mount:
    def __init__(self, cmd: list[str], mountpoint: str, env: dict | None = None) -> None:
        self.mountpoint = mountpoint
        self.proc = subprocess.Popen(cmd, env=env or os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while not os.path.ismount(mountpoint):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} mount failed: {self.proc.stderr.read().strip()[-500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not mount in 60 s")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["umount", "-l", self.mountpoint], capture_output=True)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cachefs_mount(url: str, mnt: str, cache: str, *extra: str) -> Mount:
    return Mount([sys.executable, "-m", "cachefs.cli.main", "mount", url, mnt, "--foreground", "--cache-dir", cache,
                  *extra], mnt)


def daemon_pid(cache: str, mnt: str) -> int:
    from cachefs.index.mounts import list_mounts

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for m in list_mounts(cache):
            if m["mountpoint"] == mnt and m["pid"]:
                return int(m["pid"])
        time.sleep(0.1)
    raise RuntimeError("no daemon record")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Peak RSS of a process, sampled every 20 ms while running."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            self.peak = max(self.peak, int(line.split()[1]) * 1024)
            except OSError:
                return

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


# -- the run --------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--large", type=int, default=4)
    p.add_argument("--large-mib", type=int, default=256)
    p.add_argument("--small", type=int, default=20_000)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-peers", action="store_true", help="skip rclone and s3fs")
    p.add_argument("--workers", type=int, help="FUSE request threads of the cachefs mount (default: the CLI's)")
    p.add_argument("--only-small", action="store_true", help="only the small-file passes")
    p.add_argument("--only-large", action="store_true", help="only the large-file passes")
    args = p.parse_args()
    args.mount_options = ["--workers", str(args.workers)] if args.workers else []
    if os.geteuid() != 0:
        sys.exit("fuse_bench needs root (mounts, drop_caches)")

    from cachefs.testing.s3server import S3Server

    work = tempfile.mkdtemp(prefix="cachefs-fusebench-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    server = S3Server(fast=True)
    try:
        server.start()
        run(args, server, work)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def run(args, server, work: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from cachefs.base.aio import run_sync
    from cachefs.base.config import load_config
    from cachefs.engine import Engine, ReadStream
    from cachefs.index.mounts import list_mounts

    creds = server.env()
    os.environ.update(creds)
    client = server.client()
    client.create_bucket(Bucket="bench")
    rng = random.Random(args.seed)
    local = os.path.join(work, "local")
    cache = os.path.join(work, "cache")

    # Data: large files and a small-file tree, on S3 and as a local copy.
    large = {f"f{i}.bin": b"".join(rng.randbytes(1 << 20) for _ in range(args.large_mib)) for i in range(args.large)}
    small = {f"d{i % 100:03d}/s{i:06d}.jpg": rng.randbytes(rng.randint(4 << 10, 64 << 10)) for i in range(args.small)}
    for prefix, files in (("large", large), ("small", small)):
        for rel, data in files.items():
            path = os.path.join(local, prefix, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda kv, prefix=prefix: client.put_object(Bucket="bench", Key=f"{prefix}/{kv[0]}",
                                                                       Body=kv[1]), files.items()))
    large_bytes = sum(len(d) for d in large.values())
    small_bytes = sum(len(d) for d in small.values())
    del large
    print(f"# data: {args.large} × {args.large_mib} MiB large files, {len(small)} small files "
          f"({small_bytes / 2**20:.0f} MiB, 4–64 KiB); S3 {server.endpoint}; {os.cpu_count()} CPUs")

    cli = [sys.executable, "-m", "cachefs.cli.main"]
    for prefix in ("large", "small"):
        subprocess.run([*cli, "prefetch", f"s3://bench/{prefix}", "-q", "--cache-dir", cache], check=True)

    config = load_config(None, overrides={"cache_dir": cache})
    engine = Engine(config)
    ds = run_sync(engine.open_dataset("s3://bench/large"))
    names = sorted(e.path for e in ds.walk_files())
    raw_paths = [engine.local_path(ds, ds.stat(n)) for n in names]
    assert all(raw_paths), "large files not fully cached"
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    readers = min(args.large, 4)

    def large_passes(label: str, mount_paths: list[str], base_paths: list[str], base_label: str) -> None:
        for n in (1, readers):
            mine, base = [], []
            for _ in range(args.rounds):
                for paths, out in ((base_paths, base), (mount_paths, mine)):
                    drop_caches()
                    secs, nbytes = parallel_read(split(paths, n) if n > 1 else [paths])
                    assert nbytes == large_bytes, (nbytes, large_bytes)
                    out.append(nbytes / secs / 1e9)
            m, b = statistics.median(mine), statistics.median(base)
            print(f"large {label:<28} x{n}: {m:6.2f} GB/s vs {base_label} {b:6.2f} GB/s = {m / b:.2f}×")

    # 1) passthrough, 2) userspace, both on fully cached files.
    modes = () if args.only_small else (("cached, passthrough", ()), ("cached, userspace path", ("--no-passthrough",)))
    for label, extra in modes:
        mount = cachefs_mount("s3://bench/large", mnt, cache, *extra, *args.mount_options)
        try:
            large_passes(label, [os.path.join(mnt, n) for n in names], raw_paths, "raw read")
        finally:
            mount.close()

    # 3) partially cached: only the first half of every file is local, the rest comes from S3.
    local_large = [os.path.join(local, "large", n) for n in names]
    mine, base, engine_only = [], [], []
    for _ in range(0 if args.only_small else args.rounds):
        engine.purge_sync(ds.ref.id)
        for n in names:
            e = ds.stat(n)
            run_sync(engine.read(ds, e, 0, e.size // 2))
        drop_caches()
        secs, nbytes = parallel_read([local_large])
        base.append(nbytes / secs / 1e9)
        mount = cachefs_mount("s3://bench/large", mnt, cache, *args.mount_options)
        try:
            drop_caches()
            secs, nbytes = parallel_read([[os.path.join(mnt, n) for n in names]])
            assert nbytes == large_bytes
            mine.append(nbytes / secs / 1e9)
        finally:
            mount.close()
        # The same half-cached state read by the engine in this process (no FUSE): what the origin allows.
        engine.purge_sync(ds.ref.id)
        for n in names:
            e = ds.stat(n)
            run_sync(engine.read(ds, e, 0, e.size // 2))
        drop_caches()
        t = time.perf_counter()
        for n in names:
            e, stream, off = ds.stat(n), ReadStream(), 0
            while off < e.size:
                off += len(run_sync(engine.read(ds, e, off, min(e.size, off + CHUNK), stream)))
        engine_only.append(large_bytes / (time.perf_counter() - t) / 1e9)
    if mine:
        m, b, eo = statistics.median(mine), statistics.median(base), statistics.median(engine_only)
        print(f"large {'half cached (rest from S3)':<28} x1: {m:6.2f} GB/s vs raw read {b:6.2f} GB/s = {m / b:.2f}×; "
              f"vs the engine alone (no FUSE) {eo:.2f} GB/s = {m / eo:.2f}×")
        # What the server allows: the uncached halves as bare ranged GETs of one block each, as many in flight as
        # the engine keeps, nothing stored. Even with the cached halves free, a read cannot beat this.
        bs, ranges = config.cache.block_size, []
        for n in names:
            size = ds.stat(n).size
            ranges += [(f"large/{n}", lo, min(size, lo + bs)) for lo in range(size // 2 // bs * bs, size, bs)]
        secs = server_ceiling(server.endpoint, ranges, config.engine.max_concurrent_fetches)
        top = large_bytes / secs / 1e9
        print(f"large {'half cached: server ceiling':<28}    {top:6.2f} GB/s (the S3 halves by bare ranged GETs in "
              f"{secs:.2f} s, the cached halves free) = {top / b:.2f}× raw read; the mount reached {m / top:.2f}× it")
        bare = [bare_caching_client(server.endpoint, ranges, local_large, os.path.join(work, "bare"),
                                    config.engine.max_concurrent_fetches) for _ in range(args.rounds)]
        bc = large_bytes / statistics.median(bare) / 1e9
        print(f"large {'half cached: caching client':<28}    {bc:6.2f} GB/s (the same GETs written into sparse copies, "
              f"no checksums, no FUSE, the cached halves read meanwhile) = {bc / b:.2f}× raw read; the mount "
              f"reached {m / bc:.2f}× it")
    run_sync(engine.aclose())

    if args.only_large:
        return

    # 4) small files, warm, N readers in a seeded random order.
    small_names = list(small)
    random.Random(args.seed).shuffle(small_names)
    del small

    def warm_up(root: str) -> None:  # one pass first: page cache, dentries, vfs caches
        parallel_read(split([os.path.join(root, n) for n in small_names], args.readers))

    def files_per_s(root: str, rounds: int) -> float:
        paths = [os.path.join(root, n) for n in small_names]
        rates = []
        for _ in range(rounds):
            secs, nbytes = parallel_read(split(paths, args.readers))
            assert nbytes == small_bytes, (nbytes, small_bytes)
            rates.append(len(paths) / secs)
        return statistics.median(rates)

    mount = cachefs_mount("s3://bench/small", mnt, cache, *args.mount_options)
    try:
        pid = daemon_pid(cache, mnt)
        sampler = RssSampler(pid)
        warm_up(mnt)
        cpu0 = cpu_seconds(pid)
        mine = files_per_s(mnt, args.rounds)
        cpu = cpu_seconds(pid) - cpu0
        record = next((r for r in list_mounts(cache) if r["mountpoint"] == mnt), {})
        # The same rounds with the page cache dropped first: every file now reaches the daemon (LOOKUP, GETATTR,
        # READ), so its CPU per file is what the per-request work (metrics included) costs.
        cold_cpu = 0.0
        for _ in range(args.rounds):
            drop_caches()
            cpu0 = cpu_seconds(pid)
            secs, nbytes = parallel_read(split([os.path.join(mnt, n) for n in small_names], args.readers))
            assert nbytes == small_bytes, (nbytes, small_bytes)
            cold_cpu += cpu_seconds(pid) - cpu0
        peak = sampler.stop()
    finally:
        mount.close()
    warm_up(os.path.join(local, "small"))
    disk = files_per_s(os.path.join(local, "small"), args.rounds)
    print(f"small files warm x{args.readers}: cachefs {mine:8.0f} files/s vs local disk {disk:8.0f} files/s "
          f"= {mine / disk:.2f}×")
    opened = len(small_names) * args.rounds
    mode = "open-less: the kernel sends no OPEN" if record.get("opens_skipped") else "OPEN and RELEASE answered"
    print(f"daemon CPU per small file read in the warm rounds: {cpu / opened * 1e6:.1f} µs ({opened} files; {mode})")
    print(f"daemon CPU per small file read, page cache dropped before each round: {cold_cpu / opened * 1e6:.1f} µs "
          f"({opened} files: LOOKUP, GETATTR and READ answered from the cache disk)")
    budget = config.engine.memory_budget
    print(f"daemon peak RSS during the small-file pass: {peak / 2**20:.0f} MiB "
          f"(memory budget for in-flight data {budget / 2**20:.0f} MiB)")

    if args.no_peers:
        return
    for name, make in (("rclone", rclone_mount), ("s3fs", s3fs_mount)):
        if shutil.which(name) is None:
            print(f"small files warm x{args.readers}: {name} not installed (apt-get install {name}), skipped")
            continue
        peer_cache = os.path.join(work, f"{name}-cache")
        os.makedirs(peer_cache)
        try:
            mount = make(server.endpoint, mnt, peer_cache, creds, work)
        except RuntimeError as exc:
            print(f"small files warm x{args.readers}: {name} failed to mount: {exc}")
            continue
        try:
            warm_up(os.path.join(mnt, "small"))
            theirs = files_per_s(os.path.join(mnt, "small"), 1)
        finally:
            mount.close()
        print(f"small files warm x{args.readers}: cachefs {mine:8.0f} files/s vs {name} {theirs:8.0f} files/s "
              f"= {mine / theirs:.1f}×")


def rclone_mount(endpoint: str, mnt: str, cache: str, creds: dict, work: str, bucket: str = "bench") -> Mount:
    # rclone refuses a custom CA bundle on a plain-HTTP endpoint: leave this machine's AWS_CA_BUNDLE out.
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env |= {"RCLONE_CONFIG_B_TYPE": "s3", "RCLONE_CONFIG_B_PROVIDER": "Other",
           "RCLONE_CONFIG_B_ACCESS_KEY_ID": creds["AWS_ACCESS_KEY_ID"],
           "RCLONE_CONFIG_B_SECRET_ACCESS_KEY": creds["AWS_SECRET_ACCESS_KEY"],
           "RCLONE_CONFIG_B_ENDPOINT": endpoint, "RCLONE_CONFIG_B_REGION": creds["AWS_REGION"]}
    return Mount(["rclone", "mount", f"b:{bucket}", mnt, "--vfs-cache-mode", "full", "--cache-dir", cache, "--read-only",
                  "--config", "/dev/null"], mnt, env)


def s3fs_mount(endpoint: str, mnt: str, cache: str, creds: dict, work: str) -> Mount:
    passwd = os.path.join(work, "s3fs.passwd")
    with open(passwd, "w") as f:
        f.write(f"{creds['AWS_ACCESS_KEY_ID']}:{creds['AWS_SECRET_ACCESS_KEY']}\n")
    os.chmod(passwd, 0o600)
    return Mount(["s3fs", "bench", mnt, "-f", "-o", f"url={endpoint},use_path_request_style,passwd_file={passwd},"
                  f"use_cache={cache},ro"], mnt)


if __name__ == "__main__":
    main()

"""A cache group against the same nodes caching alone, measured in one run (root: network namespaces).

Four nodes, each in a network namespace of its own on a bridge, each with a cache of 35 % of the dataset: no node
can hold it, the group can. The origin (moto) sits in its own namespace behind a capped link (1 Gbit/s, 10 ms
per request). Every node reads the whole dataset (large and small files) in two epochs, each in its own
shuffled order, through ``cachefs::``; every byte is checked against the origin's.

* independent: today's behaviour, every node caches alone;
* group: ``cachefs agent`` on every node (static members, a shared secret), readers go through their node's
  agent's group.

Printed: origin bytes per epoch (as a multiple of the dataset), epoch times and their ratio, and a cold block
through the group against straight from the origin. The yardstick for epoch 1 is the origin link itself: the
dataset's bytes at the link's rate, the least any group must wait for.

    python -m bench.cluster_bench                  # 4 nodes, 8 x 24 MiB + 400 x 64 KiB
    python -m bench.cluster_bench --large 4 --small 100   # quicker
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

from cachefs.testing.netlab import NetLab, netlab_available
from cachefs.testing.s3server import S3Server

READER = r"""
import hashlib, json, random, sys, time
import fsspec
url, cache_dir, seed, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache_dir, dataset=url)
paths = sorted(fs.find(url))
random.Random(seed).shuffle(paths)
paths = paths[rank::world]  # (world 1: the whole dataset; else DistributedSampler's share of this rank)
start = time.perf_counter()
out = {}
for path in paths:
    with fs.open(path, "rb") as f:
        out[path[len(url.split("://", 1)[1]) + 1:]] = hashlib.sha256(f.read()).hexdigest()
print(json.dumps({"seconds": time.perf_counter() - start, "sha256": out}))
"""


BARE_PEERS = r"""
import asyncio, hashlib, os, sys, time
import aiohttp
from aiohttp import web
me, port, block, count, peers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
body = os.urandom(block)

async def main():
    app = web.Application()
    app.router.add_get("/b", lambda r: web.Response(body=body))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, me, port).start()
    await asyncio.sleep(1.0)  # the others start listening
    start = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        async def one(i):
            async with s.get(f"http://{peers[i % len(peers)]}:{port}/b") as r:
                hashlib.sha256(await r.read()).digest()
        sem = asyncio.Semaphore(8)
        async def bounded(i):
            async with sem:
                await one(i)
        await asyncio.gather(*(bounded(i) for i in range(count)))
    print(time.perf_counter() - start, flush=True)
    await asyncio.sleep(3.0)  # keep serving the others
    await runner.cleanup()

asyncio.run(main())
"""


def bare_peer_copy(lab: NetLab, env: dict, block: int, count: int) -> float:
    """Seconds for every node at once to GET ``count`` blocks from the other nodes over plain aiohttp and hash
    them (what epoch 2 of the group must at least do: no cache, no checks of ours, no files)."""
    procs = []
    for node, ip in lab.ips.items():
        others = [p for n, p in lab.ips.items() if n != node]
        procs.append(lab.popen(node, [sys.executable, "-c", BARE_PEERS, ip, "7490", str(block), str(count), *others],
                               env=env, stdout=subprocess.PIPE, text=True))
    return max(float(p.communicate(timeout=600)[0].strip()) for p in procs)


def origin_bytes(server: S3Server, sizes: dict[str, int]) -> tuple[int, int]:
    """Bytes the origin sent for GETs since the last reset (ranges from the Range header, else whole objects), and
    how many distinct ranges were asked more than once."""
    total = 0
    gets = server.requests(reset=True)["gets"]
    for key, n in gets.items():
        m = re.search(r"bytes=(\d+)-(\d+)$", key)
        if m:
            total += (int(m.group(2)) - int(m.group(1)) + 1) * n
        else:
            total += sizes.get(key.split(" ", 1)[0], 0) * n
    return total, sum(1 for n in gets.values() if n > 1)


class Run:
    def __init__(self, lab: NetLab, server: S3Server, url: str, env: dict, workdir: str) -> None:
        self.lab, self.server, self.url, self.env, self.workdir = lab, server, url, env, workdir
        self.agents: list[subprocess.Popen] = []

    def cache(self, mode: str, node: str) -> str:
        return os.path.join(self.workdir, mode, node)

    def start_agents(self, mode: str) -> None:
        secret = os.path.join(self.workdir, "secret")
        with open(secret, "w") as f:
            f.write(os.urandom(16).hex())
        peers = ",".join(f"{n}={ip}:7480" for n, ip in self.lab.ips.items())
        bucket = self.url.rsplit("/", 1)[0]
        for node, ip in self.lab.ips.items():
            ready = os.path.join(self.workdir, f"ready-{node}")
            log = open(os.path.join(self.workdir, f"agent-{node}.log"), "w")
            self.agents.append(self.lab.popen(node, [
                sys.executable, "-m", "cachefs.cli.main", "agent", "--cache-dir", self.cache(mode, node), "--group",
                "bench", "--node", node, "--listen", f"{ip}:7480", "--peers", peers, "--serve", bucket,
                "--secret-file", secret, "--ready-file", ready], env=self.env, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(self.cache(mode, node), "cluster", "members.json")):
                if self.agents[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"agent {node} did not start; see {log.name}")
                time.sleep(0.1)

    def stop_agents(self) -> None:
        for p in self.agents:
            p.terminate()
        for p in self.agents:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.agents.clear()

    def epoch(self, mode: str, epoch: int, want: dict[str, str], sharded: bool = False) -> float:
        """One epoch on every node: each reads the whole dataset in an order of its own, or (``sharded``) its
        rank's share of one shuffled order, as DistributedSampler hands it out."""
        world = len(self.lab.nodes) if sharded else 1
        procs = [self.lab.popen(node, [sys.executable, "-c", READER, self.url, self.cache(mode, node),
                                       str(epoch * 100 + (0 if sharded else i)), str(i if sharded else 0),
                                       str(world)], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
                 for i, node in enumerate(self.lab.nodes)]
        start = time.perf_counter()
        seen: dict[str, str] = {}
        for p in procs:
            out, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"reader failed: {err[-2000:]}")
            got = json.loads(out)["sha256"]
            bad = sorted(k for k in got if got[k] != want.get(k))[:5]
            if bad or (not sharded and got.keys() != want.keys()):
                raise RuntimeError(f"{mode} epoch {epoch}: wrong bytes in {bad or 'missing files'}")
            seen.update(got)
        if seen.keys() != want.keys():
            raise RuntimeError(f"{mode} epoch {epoch}: files not read: {sorted(want.keys() - seen.keys())[:5]}")
        return time.perf_counter() - start

    def cold_block(self, mode: str, key_prefix: str, count: int) -> float:
        """Mean seconds to read one cold one-block object (--block-mib) on n1 (objects put fresh at the origin)."""
        code = ("import sys, time, fsspec\nfs = fsspec.filesystem('cachefs', target_protocol='s3', "
                "cache_dir=sys.argv[2], dataset=sys.argv[1])\nfs.find(sys.argv[1])\nts = []\n"
                "for p in sys.argv[3:]:\n    t = time.perf_counter()\n    fs.cat_file(p)\n"
                "    ts.append(time.perf_counter() - t)\nprint(sum(ts) / len(ts))")
        url = f"{self.url.rsplit('/', 1)[0]}/{key_prefix}"
        paths = [f"{url}/b{i}.bin" for i in range(count)]
        probe_cache = self.cache(mode, "n1") + "-probe"
        members = os.path.join(self.cache(mode, "n1"), "cluster", "members.json")
        if os.path.exists(members):  # a reader on n1 of the group (its own cache: every block cold)
            os.makedirs(os.path.join(probe_cache, "cluster"), exist_ok=True)
            shutil.copy(members, os.path.join(probe_cache, "cluster", "members.json"))
        out = self.lab.run("n1", [sys.executable, "-c", code, url, probe_cache, *paths],
                           env=self.env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return float(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--large", type=int, default=8, help="large files")
    ap.add_argument("--large-mib", type=int, default=24)
    ap.add_argument("--small", type=int, default=400, help="small files")
    ap.add_argument("--small-kib", type=int, default=64)
    ap.add_argument("--capacity", type=float, default=0.35, help="each node's cache, as a fraction of the dataset")
    ap.add_argument("--origin-mbit", type=int, default=1000)
    ap.add_argument("--delay-ms", type=float, default=10.0, help="origin latency per request")
    ap.add_argument("--block-mib", type=int, default=1, help="cache block size (more keys: owners' shares even out)")
    ap.add_argument("--dirs", type=int, default=40, help="directories the small files are spread over")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--sharded", action="store_true",
                    help="each epoch, every node reads its rank's share of one shuffled order (DistributedSampler) "
                         "instead of the whole dataset; with --capacity 0.125 on 4 nodes the group holds half")
    args = ap.parse_args()
    why = netlab_available()
    if why:
        sys.exit(f"cluster_bench: {why}")
    rng = random.Random(7)
    files = {f"large/{i:02d}.bin": rng.randbytes(args.large_mib << 20) for i in range(args.large)}
    files.update({f"small/d{i % args.dirs}/{i:05d}.bin": rng.randbytes(args.small_kib << 10) for i in range(args.small)})
    total = sum(len(b) for b in files.values())
    want = {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}
    workdir = tempfile.mkdtemp(prefix="cachefs-cluster-bench-")
    results: dict[str, dict] = {}
    with NetLab(args.nodes, origin_mbit=args.origin_mbit, host=True) as lab:
        server = S3Server(host=lab.origin_ip, delay_ms=args.delay_ms, netns=lab.origin_ns).start()
        try:
            client = server.client()
            client.create_bucket(Bucket="bench")
            for path, data in files.items():
                client.put_object(Bucket="bench", Key=f"ds/{path}", Body=data)
            for i in range(16):
                client.put_object(Bucket="bench", Key=f"probe-independent/b{i}.bin", Body=rng.randbytes(args.block_mib << 20))
                client.put_object(Bucket="bench", Key=f"probe-group/b{i}.bin", Body=rng.randbytes(args.block_mib << 20))
            sizes = {f"/bench/ds/{p}": len(b) for p, b in files.items()}
            env = {**os.environ, **server.env(), "CACHEFS_CACHE_CAPACITY": str(int(total * args.capacity)),
                   "CACHEFS_CACHE_MIN_FREE": "0", "CACHEFS_METRICS_DIR": "",
                   "CACHEFS_CACHE_BLOCK_SIZE": str(args.block_mib << 20)}
            run = Run(lab, server, "s3://bench/ds", env, workdir)
            for mode in ("independent", "group"):
                if mode == "group":
                    run.start_agents(mode)
                server.requests(reset=True)
                epochs = []
                for e in range(1, args.epochs + 1):
                    seconds = run.epoch(mode, e, want, args.sharded)
                    nbytes, repeated = origin_bytes(server, sizes)
                    epochs.append((seconds, nbytes, repeated))
                cold = run.cold_block(mode, f"probe-{mode}", 16)
                if mode == "group":
                    blocks = total // (args.block_mib << 20)
                    results["bare"] = bare_peer_copy(lab, env, args.block_mib << 20, blocks * (args.nodes - 1) // args.nodes)
                results[mode] = {"epochs": epochs, "cold_block_s": cold}
                run.stop_agents()
        finally:
            server.stop()
    if os.environ.get("CACHEFS_BENCH_KEEP"):
        print(f"# kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    link_s = total * 8 / (args.origin_mbit * 1e6)
    print(f"{args.nodes} nodes, dataset {total / 2**20:.0f} MiB ({args.large} x {args.large_mib} MiB + "
          f"{args.small} x {args.small_kib} KiB), each cache {args.capacity:.0%} of it; origin {args.origin_mbit} "
          f"Mbit/s + {args.delay_ms:g} ms per request, in its own namespace; every byte checked")
    print(f"yardstick: the dataset over the origin link once = {link_s:.1f} s")
    print(f"{'':12} " + " ".join(f"{f'epoch {e} s':>10} {'origin x':>9} {'asked 2+':>9}"
                                 for e in range(1, args.epochs + 1)) + f" {'cold block':>17}")
    for mode in ("independent", "group"):
        r = results[mode]
        print(f"{mode:12} " + " ".join(f"{t:10.1f} {b / total:9.2f} {n:9d}" for t, b, n in r["epochs"])
              + f" {r['cold_block_s'] * 1e3:14.0f} ms")
    ind, grp = results["independent"]["epochs"], results["group"]["epochs"]
    if args.sharded:
        held = min(1.0, args.nodes * args.capacity)
        print(f"sharded epochs: the group holds {held:.0%} of the dataset, so each epoch needs {1 - held:.2f}x it from "
              f"the origin at least; the group's epochs from 2 on: "
              + ", ".join(f"{b / total:.2f}x" for _, b, _ in grp[1:]) + " (target: within 10 % of it)")
    print("('asked 2+': ranges or files the origin was asked for more than once in that epoch)")
    print(f"group vs independent: epoch 1 {ind[0][0] / grp[0][0]:.2f}x faster, epoch 2 {ind[1][0] / grp[1][0]:.2f}x "
          f"faster; origin bytes epoch 1 {grp[0][1] / total:.2f}x the dataset (target <= 1.1), epoch 2 "
          f"{grp[1][1] / total:.2f}x; group epoch 1 at {link_s / grp[0][0]:.2f}x the link yardstick")
    print(f"yardstick for epoch 2: every node GETting its peers' share ({(args.nodes - 1) / args.nodes:.0%} of the "
          f"dataset) from the others over bare aiohttp and hashing it, all at once: {results['bare']:.1f} s; the "
          f"group's epoch 2 at {results['bare'] / grp[1][0]:.2f}x of it (2 vCPUs shared by {args.nodes} agents and "
          f"{args.nodes} readers)")
    print(f"cold block through the group / straight from the origin: "
          f"{results['group']['cold_block_s'] / results['independent']['cold_block_s']:.2f}x the time")


if __name__ == "__main__":
    main()

"""Chaos in a cache group, every byte checked: a member killed mid-epoch and a block rotten on an owner's disk.

Three agents (``cachefs agent``, static members, a shared secret) on loopback, one moto origin that counts what it
sends, readers through ``cachefs::`` in processes of their own, each epoch in a shuffled order:

1. n1 reads the dataset (the owners fetch it from the origin once; n1 keeps copies);
2. a block of a large file is corrupted on n1's disk (bytes overwritten in its cache file);
3. n2 reads the dataset, and when it is half way through, n3's agent is killed with ``kill -9``;
4. n1 reads the dataset again: the rotten block is caught by its checksum and taken again.

Printed, against targets: wrong bytes (0), bytes the origin sent as a multiple of the dataset (<= 1.1: a lost
member's keys come from the members holding copies, a rotten block from a holder or, once, the origin), and the
two events as the metrics show them: ``cachefs_corrupt_reads_total`` (and ``cachefs status``'s
``corrupt_reads``), and ``cachefs_peer_errors_total{reason="unreachable"}`` (requests to n3 once it was gone).

    python -m bench.group_chaos               # the run in .ci/run (about a minute)
    python -m bench.group_chaos --rounds 5    # the whole sequence five times, new seeds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from cachefs.testing.s3server import S3Server

BLOCK = 256 * 1024
READER = r"""
import hashlib, json, random, sys
import fsspec
url, cache_dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache_dir, dataset=url)
paths = sorted(fs.find(url))
random.Random(seed).shuffle(paths)
out = {}
for i, path in enumerate(paths):
    with fs.open(path, "rb") as f:
        out[path[len(url.split("://", 1)[1]) + 1:]] = hashlib.sha256(f.read()).hexdigest()
    print(f"progress {i + 1} {len(paths)}", file=sys.stderr, flush=True)
print(json.dumps(out))
"""
CACHE_FILE = r"""
import sys
from cachefs.base.config import load_config
from cachefs.engine import Engine
from cachefs.base.aio import run_sync
engine = Engine(load_config(overrides={"cache_dir": sys.argv[1]}))
ds = run_sync(engine.open_dataset(sys.argv[2]))
print(engine.local_path(ds, ds.file(sys.argv[3])))
run_sync(engine.aclose())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    def __init__(self, workdir: str, env: dict, url: str, names: list[str]) -> None:
        self.workdir, self.env, self.url, self.names = workdir, env, url, names
        self.ports = {n: _free_port() for n in names}
        self.secret = os.path.join(workdir, "secret")
        with open(self.secret, "w") as f:
            f.write(os.urandom(16).hex())
        os.chmod(self.secret, 0o600)
        self.agents: dict[str, subprocess.Popen] = {}

    def cache(self, node: str) -> str:
        return os.path.join(self.workdir, f"cache-{node}")

    def start(self, node: str) -> None:
        peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in self.ports.items())
        log = open(os.path.join(self.workdir, f"agent-{node}.log"), "a")
        self.agents[node] = subprocess.Popen(
            [sys.executable, "-m", "cachefs.cli.main", "agent", "--cache-dir", self.cache(node), "--group", "chaos",
             "--node", node, "--listen", f"127.0.0.1:{self.ports[node]}", "--peers", peers,
             "--secret-file", self.secret], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.cache(node), "cluster", "members.json")):
            if self.agents[node].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent {node} did not start; see {log.name}")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                p.terminate()
        for p in self.agents.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def reader(self, node: str, seed: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", READER, self.url, self.cache(node), str(seed)], env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wrong_files(proc: subprocess.Popen, want: dict[str, str], *, kill_at_half=None) -> int:
    """Wait for a reader (calling ``kill_at_half`` once it has read half the files); how many files differ."""
    assert proc.stderr is not None and proc.stdout is not None
    err_tail: list[str] = []
    for line in proc.stderr:
        m = re.match(r"progress (\d+) (\d+)", line)
        if m and kill_at_half is not None and int(m.group(1)) * 2 >= int(m.group(2)):
            kill_at_half()
            kill_at_half = None
        elif not m:
            err_tail = [*err_tail, line][-40:]
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError("reader failed:\n" + "".join(err_tail))
    got = json.loads(out)
    return sum(1 for p in want if got.get(p) != want[p]) + len(set(got) - set(want))


def origin_bytes(server: S3Server, sizes: dict[str, int]) -> int:
    total = 0
    for key, n in server.requests(reset=True)["gets"].items():
        m = re.search(r"bytes=(\d+)-(\d+)$", key)
        total += n * ((int(m.group(2)) - int(m.group(1)) + 1) if m else sizes.get(key.split(" ", 1)[0], 0))
    return total


def corrupt_a_block(group: Group, node: str, path: str, rng: random.Random) -> None:
    """Overwrite bytes inside block 1 of ``path`` in ``node``'s cache file (as a rotting disk would)."""
    out = subprocess.run([sys.executable, "-c", CACHE_FILE, group.cache(node), group.url, path], env=group.env,
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    with open(out.stdout.strip(), "r+b") as f:
        f.seek(BLOCK + rng.randrange(BLOCK - 16))
        f.write(os.urandom(16))


def metric(metrics_dir: str, cache_dir: str, name: str, **labels: str) -> float:
    """A metric summed over the node's processes, as the node's endpoint serves it."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        from cachefs.base.config import load_config
        from cachefs.status.server import node_registry

        registry = node_registry(load_config(env={}, overrides={"cache_dir": cache_dir}))
        total = 0.0
        for family in registry.collect():
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total
    finally:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]


def one_round(server: S3Server, env: dict, files: dict[str, bytes], seed: int) -> dict:
    rng = random.Random(seed)
    bucket = f"chaos{seed}"
    client = server.client()
    client.create_bucket(Bucket=bucket)
    for path, data in files.items():
        client.put_object(Bucket=bucket, Key=f"ds/{path}", Body=data)
    sizes = {f"/{bucket}/ds/{p}": len(b) for p, b in files.items()}
    want = {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}
    workdir = tempfile.mkdtemp(prefix="cachefs-group-chaos-")
    metrics_dir = os.path.join(workdir, "metrics")
    os.makedirs(metrics_dir)
    # The agents write to the node's metrics directory by default; the readers here do too (as FUSE daemons do),
    # so that a reader's fallback from a dead member shows at the node's endpoint.
    env = {**env, "CACHEFS_METRICS_DIR": metrics_dir, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    group = Group(workdir, env, f"s3://{bucket}/ds", ["n1", "n2", "n3"])
    result: dict = {"seed": seed}
    try:
        for n in group.names:
            group.start(n)
        server.requests(reset=True)
        wrong = wrong_files(group.reader("n1", rng.randrange(1 << 30)), want)
        large = sorted(p for p in files if p.startswith("large/"))
        corrupt_a_block(group, "n1", rng.choice(large), rng)

        def kill_n3() -> None:
            group.agents["n3"].send_signal(signal.SIGKILL)
            result["killed_at"] = time.monotonic()

        wrong += wrong_files(group.reader("n2", rng.randrange(1 << 30)), want, kill_at_half=kill_n3)
        wrong += wrong_files(group.reader("n1", rng.randrange(1 << 30)), want)
        result["origin_x"] = origin_bytes(server, sizes) / sum(len(b) for b in files.values())
        result["wrong_files"] = wrong
        status = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--json", "--cache-dir",
                                 group.cache("n1")], env=env, capture_output=True, text=True, timeout=60)
        deadline = time.monotonic() + 15  # the agents add their counts at their next statistics flush (2 s)
        while True:
            status = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--json", "--cache-dir",
                                     group.cache("n1")], env=env, capture_output=True, text=True, timeout=60)
            result["status_corrupt"] = json.loads(status.stdout).get("corrupt_reads", {}) if status.returncode == 0 \
                else {}
            result["metric_corrupt"] = metric(metrics_dir, group.cache("n1"), "cachefs_corrupt_reads_total")
            result["metric_unreachable"] = metric(metrics_dir, group.cache("n2"), "cachefs_peer_errors_total",
                                                  reason="unreachable")
            counted = result["metric_corrupt"] and result["status_corrupt"] and result["metric_unreachable"]
            if counted or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        group.stop()
        if os.environ.get("CACHEFS_BENCH_KEEP"):
            print(f"# kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--large", type=int, default=6, help="large files")
    ap.add_argument("--large-kib", type=int, default=2048)
    ap.add_argument("--small", type=int, default=150, help="small files")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    files = {f"large/{i:02d}.bin": rng.randbytes(args.large_kib << 10) for i in range(args.large)}
    files.update({f"small/d{i % 10}/{i:04d}.bin": rng.randbytes(rng.randrange(200, 20_000)) for i in range(args.small)})
    total = sum(len(b) for b in files.values())
    server = S3Server().start()
    env = {**os.environ, **server.env(), "CACHEFS_CACHE_BLOCK_SIZE": str(BLOCK), "CACHEFS_CACHE_MIN_FREE": "0",
           "CACHEFS_ORIGIN_BACKOFF_BASE": "0.001", "CACHEFS_ORIGIN_BACKOFF_MAX": "0.05"}
    try:
        results = [one_round(server, env, files, args.seed * 1000 + r) for r in range(args.rounds)]
    finally:
        server.stop()
    print(f"3 agents on loopback, dataset {total / 2**20:.1f} MiB ({args.large} x {args.large_kib} KiB + {args.small} "
          "small files); n1 reads, a block of n1's is corrupted, n2 reads and n3 is killed (-9) half way, n1 reads again")
    print(f"{'round':>5} {'wrong files':>12} {'origin x':>9} {'corrupt (metric)':>17} {'corrupt (status)':>17} "
          f"{'member unreachable':>19}")
    for i, r in enumerate(results):
        print(f"{i:5d} {r['wrong_files']:12d} {r['origin_x']:9.2f} {r['metric_corrupt']:17.0f} "
              f"{sum(r['status_corrupt'].values()):17d} {r['metric_unreachable']:19.0f}")
    ok = all(r["wrong_files"] == 0 and r["origin_x"] <= 1.1 and r["metric_corrupt"] >= 1
             and sum(r["status_corrupt"].values()) >= 1 and r["metric_unreachable"] >= 1 for r in results)
    print("targets: 0 wrong files, origin <= 1.1x, the corruption and the lost member both counted: "
          + ("met" if ok else "MISSED"))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Chaos with every byte checked (root: a FUSE mount and a tmpfs cache).

Readers run through the mount and through ``cachefs::`` at the same time, every byte compared with the origin's
bytes of a version that file has had, while a fault injector, at random:

* makes the origin (moto behind a faulting proxy) answer 503, SlowDown, stall past the request timeout, cut
  bodies short and reset connections;
* changes an object at the origin (a new ETag) and runs ``cachefs refresh``;
* ``kill -9``s the FUSE daemon (the holder starts another) and a running ``cachefs prefetch``;
* fills the cache disk (a small tmpfs) and frees it again;
* runs ``cachefs evict`` under the readers.

At the end, a quiet phase: the dataset prefetched, the daemon killed with nothing in flight, and what is cached
compared before and after. Printed: reads and bytes checked, wrong bytes (target 0), reader-visible errors by
errno (ESTALE is documented after a change; anything else counts against the target of 0), cached bytes lost to
kill -9, the daemon's peak RSS against the memory budget, and how many faults of each kind were injected.

    python -m bench.chaos --seconds 60       # the run in .ci/run
    python -m bench.chaos --seconds 1800     # the long one
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

from cachefs.testing.s3server import S3Server

BLOCK = 256 * 1024
BUDGET = 32 << 20
READER = r"""
import errno, hashlib, json, os, random, sys, time
mode, root, allowed_path, stop_path, seed = sys.argv[1:6]
rng = random.Random(int(seed))
if mode == "fsspec":
    import fsspec
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=sys.argv[6], dataset=root,
                           target_options={"endpoint_url": sys.argv[7]})
reads = wrong = nbytes = 0
errors = {}
bad = []
while not os.path.exists(stop_path):
    with open(allowed_path) as f:
        allowed = json.load(f)
    path = rng.choice(sorted(allowed))
    try:
        if mode == "fsspec":
            data = fs.cat_file(f"{root}/{path}")
        else:
            with open(os.path.join(root, path), "rb") as f:
                data = f.read()
    except OSError as exc:
        name = errno.errorcode.get(exc.errno, type(exc).__name__)
        errors[name] = errors.get(name, 0) + 1
        time.sleep(0.05)
        continue
    with open(allowed_path) as f:  # a version written while we read counts too
        allowed = json.load(f)
    reads += 1
    nbytes += len(data)
    if hashlib.sha256(data).hexdigest() not in allowed[path]:
        wrong += 1
        bad.append(path)
print(json.dumps({"mode": mode, "reads": reads, "bytes": nbytes, "wrong": wrong, "errors": errors, "bad": bad[:10]}))
"""


class FaultProxy:
    """An HTTP proxy in front of the origin that fails a share of object GETs in one of five ways."""

    KINDS = ("503", "SlowDown", "stall", "truncated", "reset")

    def __init__(self, target: str, rate: float, stall_s: float, rng: random.Random) -> None:
        self.target, self.rate, self.stall_s, self.rng = target, rate, stall_s, rng
        self.injected: Counter[str] = Counter()
        self.enabled = False
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True, name="chaos-proxy").start()
        self._ready.wait(10)

    def _run(self) -> None:
        import aiohttp
        from aiohttp import web

        async def handle(request: web.Request) -> web.StreamResponse:
            kind = None
            if self.enabled and request.method == "GET" and "Range" in request.headers and self.rng.random() < self.rate:
                kind = self.rng.choice(self.KINDS)
                self.injected[kind] += 1
            if kind == "503":
                return web.Response(status=503, text="<Error><Code>ServiceUnavailable</Code></Error>")
            if kind == "SlowDown":
                return web.Response(status=503, text="<Error><Code>SlowDown</Code><Message>Reduce your request rate"
                                                     "</Message></Error>", content_type="application/xml")
            if kind == "stall":
                await asyncio.sleep(self.stall_s)
            if kind == "reset":
                if request.transport is not None:
                    request.transport.abort()
                return web.Response(status=500)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            async with self.session.request(request.method, self.target + request.path_qs, headers=headers,
                                            data=await request.read(), allow_redirects=False) as up:
                body = await up.read()
                out = {k: v for k, v in up.headers.items()
                       if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding")}
                if kind == "truncated" and len(body) > 10:
                    resp = web.StreamResponse(status=up.status, headers={**out, "Content-Length": str(len(body))})
                    try:
                        await resp.prepare(request)
                        await resp.write(body[:len(body) // 2])
                    except ConnectionError:  # the client gave up first: the fault happened all the same
                        pass
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                return web.Response(status=up.status, body=body, headers=out)

        async def start() -> None:
            self.session = aiohttp.ClientSession(auto_decompress=False)
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachefs.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def mount_record(cache: str, env: dict) -> dict | None:
    out = cli("status", "--cache-dir", cache, "--json", env=env)
    try:
        mounts = json.loads(out.stdout).get("mounts") or []
    except ValueError:
        return None
    return mounts[0] if mounts else None


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cached_bytes(cache: str, env: dict) -> int:
    out = json.loads(cli("status", "--cache-dir", cache, "--json", env=env).stdout)
    return sum(int(d.get("cached_bytes", 0)) for d in out.get("datasets") or [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--fault-rate", type=float, default=0.1, help="share of object GETs that fail")
    ap.add_argument("--disk-mib", type=int, default=24, help="the cache's tmpfs")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        sys.exit("chaos: needs root and /dev/fuse (a FUSE mount and a tmpfs cache)")
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="cachefs-chaos-")
    cache, mnt = os.path.join(work, "cache"), os.path.join(work, "mnt")
    os.makedirs(cache)
    os.makedirs(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.disk_mib}m", "tmpfs", cache], check=True)
    server = S3Server().start()
    procs: list[subprocess.Popen] = []
    faults: Counter[str] = Counter()
    try:
        client = server.client()
        client.create_bucket(Bucket="chaos")
        files = {f"small/d{i % 4}/{i:03d}.bin": rng.randbytes(rng.randint(100, 60_000)) for i in range(60)}
        files.update({f"large/{i}.bin": rng.randbytes(rng.randint(1, 4) * BLOCK + rng.randint(0, BLOCK))
                      for i in range(8)})
        for path, data in files.items():
            client.put_object(Bucket="chaos", Key=f"ds/{path}", Body=data)
        allowed = {p: [hashlib.sha256(b).hexdigest()] for p, b in files.items()}
        allowed_path, stop_path = os.path.join(work, "allowed.json"), os.path.join(work, "stop")

        def publish_allowed() -> None:
            tmp = allowed_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(allowed, f)
            os.replace(tmp, allowed_path)

        publish_allowed()
        proxy = FaultProxy(server.endpoint, args.fault_rate, 3.0, rng)
        env = {**os.environ, **server.env(), "AWS_ENDPOINT_URL": proxy.endpoint,
               "CACHEFS_ORIGIN_REQUEST_TIMEOUT": "2", "CACHEFS_ORIGIN_BACKOFF_MAX": "0.2",
               "CACHEFS_CACHE_BLOCK_SIZE": str(BLOCK), "CACHEFS_CACHE_PACK_THRESHOLD": str(64 * 1024),
               "CACHEFS_ENGINE_MEMORY_BUDGET": str(BUDGET), "CACHEFS_METRICS_DIR": ""}
        url = "s3://chaos/ds"
        r = cli("mount", url, mnt, "--cache-dir", cache, env=env)
        if r.returncode != 0:
            sys.exit(f"chaos: mount failed: {r.stderr}")
        mount_log = r.stdout.rsplit("log ", 1)[-1].rstrip(")\n")
        rec = mount_record(cache, env)
        baseline_rss = rss_kib(int(rec["pid"])) if rec and rec.get("pid") else 0  # the idle daemon, for scale
        proxy.enabled = True
        readers = [subprocess.Popen([sys.executable, "-c", READER, "mount", mnt, allowed_path, stop_path, str(i)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for i in range(2)]
        readers += [subprocess.Popen([sys.executable, "-c", READER, "fsspec", url, allowed_path, stop_path, str(10 + i),
                                      os.path.join(work, f"fsspec-cache-{i}"), proxy.endpoint], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(1)]
        procs += readers
        peak_rss, end = 0, time.monotonic() + args.seconds
        while time.monotonic() < end:
            rec = mount_record(cache, env)
            if rec and rec.get("pid"):
                peak_rss = max(peak_rss, rss_kib(int(rec["pid"])))
            action = rng.choice(["change", "kill-daemon", "kill-prefetch", "fill-disk", "evict", "quiet"])
            if action == "change":
                path = rng.choice(sorted(files))
                data = rng.randbytes(len(files[path]) or 1)
                allowed[path].append(hashlib.sha256(data).hexdigest())  # allowed before anyone can read it
                publish_allowed()
                client.put_object(Bucket="chaos", Key=f"ds/{path}", Body=data)
                files[path] = data
                if cli("refresh", url, "--cache-dir", cache, env=env).returncode == 0:
                    faults["object changed + refresh"] += 1
                else:
                    faults["object changed (refresh failed)"] += 1
            elif action == "kill-daemon" and rec and rec.get("pid"):
                os.kill(int(rec["pid"]), signal.SIGKILL)
                faults["kill -9 FUSE daemon"] += 1
            elif action == "kill-prefetch":
                p = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "prefetch", url, "--cache-dir", cache],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(rng.uniform(0.2, 1.5))
                p.kill()
                p.wait()
                faults["kill -9 prefetch"] += 1
            elif action == "fill-disk":
                filler = os.path.join(cache, "filler")
                try:
                    with open(filler, "wb") as f:
                        while True:
                            f.write(b"\0" * (1 << 20))
                            f.flush()
                except OSError:
                    pass
                time.sleep(rng.uniform(0.5, 2.0))
                os.unlink(filler)
                faults["cache disk filled, then freed"] += 1
            elif action == "evict":
                cli("evict", url, "--cache-dir", cache, env=env)
                faults["evict under readers"] += 1
            time.sleep(rng.uniform(0.2, 1.0))
        with open(stop_path, "w"):
            pass
        results = []
        for p in readers:
            try:
                results.append(json.loads(p.communicate(timeout=120)[0] or "{}"))
            except subprocess.TimeoutExpired:
                results.append({"errors": {"reader hung (no answer within 120 s)": 1}})
                print(f"chaos: a reader hung; mount state {mount_record(cache, env)}", file=sys.stderr)
        proxy.enabled = False
        faults.update({f"origin: {k}": n for k, n in proxy.injected.items()})

        # The quiet phase: all cached, the daemon killed with nothing in flight, nothing lost.
        rec = mount_record(cache, env)
        cli("prefetch", url, "--cache-dir", cache, env=env, timeout=600)
        before = cached_bytes(cache, env)
        if rec and rec.get("pid"):
            os.kill(int(rec["pid"]), signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                again = mount_record(cache, env)
                if again and again.get("pid") and again["pid"] != rec["pid"]:
                    break
                time.sleep(0.2)
        after = cached_bytes(cache, env)
    finally:
        if os.environ.get("CACHEFS_CHAOS_LOG"):
            try:
                shutil.copy(mount_log, os.environ["CACHEFS_CHAOS_LOG"])
            except (OSError, NameError):
                pass
        for p in procs:
            if p.poll() is None:
                p.kill()
        subprocess.run([sys.executable, "-m", "cachefs.cli.main", "umount", mnt], capture_output=True, timeout=60)
        subprocess.run(["umount", "-l", mnt], capture_output=True)
        subprocess.run(["umount", "-l", cache], capture_output=True)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    reads = sum(r.get("reads", 0) for r in results)
    nbytes = sum(r.get("bytes", 0) for r in results)
    wrong = sum(r.get("wrong", 0) for r in results)
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r.get("errors", {}))
    other = {k: n for k, n in errors.items() if k != "ESTALE"}
    print(f"chaos: {args.seconds:g} s, origin fault rate {args.fault_rate:.0%}, cache on a {args.disk_mib} MiB tmpfs, "
          f"2 readers through the mount + 1 through cachefs::")
    print(f"  reads checked            {reads} ({nbytes / 2**20:.1f} MiB)")
    print(f"  wrong bytes              {wrong} reads (target 0){'  ' + str([r.get('bad') for r in results]) if wrong else ''}")
    print(f"  reader-visible errors    ESTALE {errors.get('ESTALE', 0)} (documented after a change); "
          f"others {sum(other.values())} {dict(other) or ''} (target 0)")
    for r in results:
        if r.get("errors"):
            print(f"    errors seen by the {r.get('mode', '?')} reader: {r['errors']}")
    print(f"  cached bytes lost to kill -9 with nothing in flight: {max(0, before - after)} of {before} (target 0)")
    print(f"  FUSE daemon peak RSS     {peak_rss / 1024:.0f} MiB: the idle daemon's {baseline_rss / 1024:.0f} MiB "
          f"(interpreter, libraries, manifest) + {(peak_rss - baseline_rss) / 1024:.0f} MiB under load "
          f"(memory budget {BUDGET >> 20} MiB)")
    print("  faults injected:")
    for kind, n in sorted(faults.items()):
        print(f"    {kind:34} {n}")
    sys.exit(1 if wrong or other or before - after > 0 else 0)


if __name__ == "__main__":
    main()

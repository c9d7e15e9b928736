"""The cache group on one host: agents (``cachefs agent``) with a static member list and a shared secret on
loopback ports, readers in their own processes, one moto origin that counts what it is asked.

The multi-node tests with network namespaces and membership from a real API server are in tests/e2e.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from cachefs.base.types import dataset_id
from cachefs.cluster.peer_client import CHECKSUM_HEADER, MEMBER_HEADER
from tests.conftest import put_tree

BLOCK = 64 * 1024
ENV = {"CACHEFS_CACHE_BLOCK_SIZE": str(BLOCK), "CACHEFS_CACHE_PACK_THRESHOLD": str(16 * 1024),
       "CACHEFS_CACHE_PACK_SIZE": str(256 * 1024), "CACHEFS_CACHE_MIN_FREE": "0",
       "CACHEFS_ENGINE_MEMORY_BUDGET": str(8 << 20), "CACHEFS_ORIGIN_BACKOFF_BASE": "0.001",
       "CACHEFS_ORIGIN_BACKOFF_MAX": "0.01", "CACHEFS_METRICS_DIR": ""}

READER = r"""
import hashlib, json, sys
import fsspec
url, cache_dir = sys.argv[1], sys.argv[2]
fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache_dir, dataset=url)
out = {}
for path in sorted(fs.find(url)):
    with fs.open(path, "rb") as f:
        out[path[len(url.split("://", 1)[1]) + 1:]] = hashlib.sha256(f.read()).hexdigest()
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_files() -> dict[str, bytes]:
    files = {f"big/{i}.bin": os.urandom(5 * BLOCK + 1234 * i) for i in range(3)}
    files.update({f"small/d{i % 3}/{i:03d}.txt": os.urandom(500 + 37 * i) for i in range(30)})
    return files


class Group:
    """N agents of one group on loopback, each with its own cache directory."""

    def __init__(self, tmp_path, s3_env: dict, names: list[str], url: str) -> None:
        self.tmp, self.url, self.names = tmp_path, url, names
        self.secret = tmp_path / "secret"
        self.secret.write_text("group-secret-1\n")
        self.ports = {n: _free_port() for n in names}
        self.env = {**os.environ, **s3_env, **ENV}
        self.procs: dict[str, subprocess.Popen] = {}
        self.agent_args: list[str] = []
        #: The agents' --serve (None: not given, the default docs/CLUSTER.md's commands use).
        self.serve: str | None = url.rsplit("/", 1)[0]

    def cache(self, name: str) -> str:
        return str(self.tmp / f"cache-{name}")

    def peers(self, names: list[str] | None = None) -> str:
        return ",".join(f"{n}=127.0.0.1:{self.ports[n]}" for n in names or self.names)

    def start(self, name: str, members: list[str] | None = None) -> None:
        ready = self.tmp / f"ready-{name}"
        ready.unlink(missing_ok=True)
        serve = ["--serve", self.serve] if self.serve is not None else []
        with open(self.tmp / f"agent-{name}.log", "a") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "cachefs.cli.main", "agent", "--cache-dir", self.cache(name), "--group",
                 "g1", "--node", name, "--listen", f"127.0.0.1:{self.ports[name]}", "--peers", self.peers(members),
                 *serve, "--secret-file", str(self.secret), "--ready-file", str(ready), "-v", *self.agent_args],
                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert self.procs[name].poll() is None, (self.tmp / f"agent-{name}.log").read_text()
            assert time.monotonic() < deadline, "agent not ready"
            time.sleep(0.05)
        while not os.path.exists(os.path.join(self.cache(name), "cluster", "members.json")):
            time.sleep(0.05)

    def read_all(self, name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", READER, self.url, self.cache(name)], env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def finish(proc: subprocess.Popen) -> dict[str, str]:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert "Unclosed" not in err and "Traceback" not in err, err[-3000:]  # the peer client's session closed at exit
    return json.loads(out)


def expected(files: dict[str, bytes]) -> dict[str, str]:
    return {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}


@pytest.fixture
def group(tmp_path, s3):
    server, client, bucket = s3
    files = make_files()
    put_tree(client, bucket, "ds", files)
    g = Group(tmp_path, server.env(), ["n1", "n2", "n3"], f"s3://{bucket}/ds")
    g.server, g.files, g.bucket = server, files, bucket
    try:
        for n in g.names:
            g.start(n)
        server.requests(reset=True)
        yield g
    finally:
        g.stop()


def origin_bytes(g: Group) -> int:
    """Bytes of the dataset the origin sent since the last reset (ranged GETs by their range, whole ones by size)."""
    total = 0
    for key, n in dataset_gets(g).items():
        path, _, rng = key.partition(" bytes=")
        if rng:
            lo, _, hi = rng.partition("-")
            total += n * (int(hi) - int(lo) + 1)
        else:
            total += n * len(g.files[path.split("/ds/", 1)[1]])
    return total


def dataset_gets(g: Group) -> dict[str, int]:
    prefix = f"/{g.bucket}/ds/"
    return {k: n for k, n in g.server.requests()["gets"].items() if k.startswith(prefix)}


def test_the_documented_commands_read_a_dataset_from_the_origin_once(tmp_path, s3):
    """docs/CLUSTER.md's one-host commands (no --serve; a cache directory per agent), three nodes reading the dataset
    one after another: each agent fetches for the group whatever the group reads, so the origin sends the dataset
    once (a node used to fetch only datasets a reader on it had opened: 1.9-2.2x)."""
    server, client, bucket = s3
    files = make_files()
    put_tree(client, bucket, "ds", files)
    g = Group(tmp_path, server.env(), ["n1", "n2", "n3"], f"s3://{bucket}/ds")
    g.server, g.files, g.bucket, g.serve = server, files, bucket, None
    try:
        for n in g.names:
            g.start(n)
        server.requests(reset=True)
        for n in g.names:  # in turn, as a user tries it
            assert finish(g.read_all(n)) == expected(files)
        sent, size = origin_bytes(g), sum(len(b) for b in files.values())
        assert sent <= 1.1 * size, (sent, size)
    finally:
        g.stop()


def test_three_nodes_read_one_dataset_with_one_get_per_block_and_one_listing(group):
    readers = [group.read_all(n) for n in group.names]
    results = [finish(r) for r in readers]
    want = expected(group.files)
    for got in results:
        assert got == want  # every byte equal to the origin's
    asked = group.server.requests()
    gets = dataset_gets(group)
    assert max(gets.values()) == 1, {k: n for k, n in gets.items() if n > 1}  # one GET per block or file
    blocks = sum(-(-len(b) // BLOCK) for p, b in group.files.items() if p.startswith("big/"))
    assert len([k for k in gets if "/big/" in k]) == blocks
    assert len([k for k in gets if "/small/" in k]) == 30
    roots = [q for q in asked["list_queries"] if "prefix=ds%2F&" in q or q.endswith("prefix=ds%2F")]
    assert len(roots) == 1, asked["list_queries"]  # the dataset was listed once for the group


def test_a_node_without_a_manifest_takes_a_peers_and_lists_nothing(group):
    finish(group.read_all("n1"))
    lists = group.server.requests()["lists"]
    assert lists >= 1
    for n in ("n2", "n3"):
        assert finish(group.read_all(n)) == expected(group.files)
    assert group.server.requests()["lists"] == lists


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_peer_server_refuses_strangers_and_bad_requests(group):
    finish(group.read_all("n1"))
    port = group.ports["n1"]
    ds = dataset_id(group.url)
    from urllib.parse import quote

    member = {"Authorization": "Bearer group-secret-1", MEMBER_HEADER: "n2"}
    # n1 holds the blocks it owns (guests are not kept): 404 for the others when asked not to fetch, and with
    # fetch=1 it fetches those it is one of the first owners of. Every answer is the origin's bytes.
    held = None
    for fetch in ("0", "1"):
        for path in sorted(p for p in group.files if p.startswith("big/")):
            etag = group.server.client().head_object(Bucket=group.bucket, Key=f"ds/{path}")["ETag"].strip('"')
            for i in range(-(-len(group.files[path]) // BLOCK)):
                ask = f"/v1/block/{ds}?path={path}&version={quote(etag)}&block={i}"
                status, body = _get(port, f"{ask}&fetch={fetch}", member)
                assert status in (200, 404), (status, body[:300])
                if status == 200:
                    assert body == group.files[path][i * BLOCK:(i + 1) * BLOCK]
                    held = held or (ask, path, etag)
        if held:
            break
    assert held, "n1 holds and fetches no block at all"
    good, path, etag = held
    assert _get(port, good)[0] == 401  # no token
    assert _get(port, good, {**member, "Authorization": "Bearer wrong"})[0] == 401
    assert _get(port, good, {**member, MEMBER_HEADER: "stranger"})[0] == 403  # not a member of this group
    for bad, want in ((f"/v1/block/{ds}?path=../../etc/passwd&version=x&block=0", 400),
                      (f"/v1/block/{ds}?path=/etc/passwd&version=x&block=0", 400),
                      (f"/v1/block/{ds}?path={path}&version={quote(etag)}&block=-1", 400),
                      (f"/v1/block/{ds}?path={path}&version={quote(etag)}&block=99999999999", 400),
                      (f"/v1/block/{ds}?path={path}&version={quote(etag)}&block=999", 400),
                      (f"/v1/block/{ds}?path=big/0.bin&version=&block=0", 400),
                      (f"/v1/block/{ds}?path=big/0.bin&version=other-version&block=0", 404),
                      ("/v1/block/not-an-id?path=big/0.bin&version=x&block=0", 400),
                      ("/v1/block/%2E%2E%2F%2E%2E?path=big/0.bin&version=x&block=0", 400),
                      (f"/v1/manifest/{ds}?url=%00", 400)):
        status, body = _get(port, bad, member)
        assert status == want, (bad, status, body)
    # A pushed manifest (after a refresh elsewhere): only from a member, checksummed, of a dataset known here.
    def push(ds_id: str, body: bytes, headers: dict, url: str = group.url) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/manifest/{ds_id}?url={url}", data=body,
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            exc.close()
            return exc.code

    assert push(ds, b"x", {}) == 401
    assert push(ds, b"not a manifest", {**member, CHECKSUM_HEADER: "0" * 16}) == 400  # checksum
    from cachefs.base.checksum import block_checksum

    junk = b"not a manifest"
    assert push(ds, junk, {**member, CHECKSUM_HEADER: f"{block_checksum(junk):016x}"}) == 400  # does not decode
    signed = {**member, CHECKSUM_HEADER: f"{block_checksum(junk):016x}"}
    assert push(dataset_id("s3://elsewhere/x"), junk, signed) == 400  # the URL is not that dataset's
    assert push(dataset_id("s3://elsewhere/x"), junk, signed, "s3://elsewhere/x") == 404  # not known here
    # A file of another dataset that this node does not serve: nothing fetched, nothing served.
    other = dataset_id("s3://elsewhere/x")
    assert _get(port, f"/v1/block/{other}?url=s3://elsewhere/x&path=a&version=v&block=0", member)[0] == 404
    assert _get(port, f"/v1/manifest/{other}?url=s3://elsewhere/x", member)[0] == 404
    assert not any("elsewhere" in k for k in group.server.requests()["gets"])


def test_a_killed_member_costs_readers_nothing(group):
    """kill -9 of one agent: the readers of the others see right bytes and no error (its keys go to the next
    candidates); it comes back and serves again."""
    group.procs["n3"].send_signal(signal.SIGKILL)
    group.procs["n3"].wait()
    results = [finish(group.read_all(n)) for n in ("n1", "n2")]
    assert all(r == expected(group.files) for r in results)
    group.start("n3")
    assert finish(group.read_all("n3")) == expected(group.files)


def test_a_member_killed_between_readers_costs_the_origin_no_second_read(group):
    """One node reads the dataset (every block and small file once from the origin, fetched by its owner, a copy
    kept by the reader); kill -9 of another member; the third reads it all: the keys that moved to new owners are
    taken from the members holding copies, not from the origin again (this used to cost 1.4x)."""
    size = sum(len(b) for b in group.files.values())
    assert finish(group.read_all("n1")) == expected(group.files)
    group.procs["n3"].send_signal(signal.SIGKILL)
    group.procs["n3"].wait()
    assert finish(group.read_all("n2")) == expected(group.files)
    sent = origin_bytes(group)
    assert sent <= 1.1 * size, (sent, size)


def _cached_bytes(group: Group, name: str) -> int:
    proc = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--json", "--cache-dir",
                           group.cache(name)], env=group.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["used_bytes"]


def test_evict_with_group_purges_a_dataset_from_every_member(group):
    """`cachefs evict URL --group` (how to purge a dataset a member may have poisoned, docs/SECURITY.md): every
    member drops what it holds of it, and the next read takes it from the origin again."""
    for n in group.names:
        assert finish(group.read_all(n)) == expected(group.files)
    assert all(_cached_bytes(group, n) > 0 for n in group.names)
    proc = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "evict", group.url, "--group", "--cache-dir",
                           group.cache("n1")], env=group.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert all(f"{n}: evicted" in proc.stdout for n in group.names), proc.stdout  # its own agent too
    assert all(_cached_bytes(group, n) == 0 for n in group.names), [_cached_bytes(group, n) for n in group.names]
    group.server.requests(reset=True)
    assert finish(group.read_all("n2")) == expected(group.files)
    size = sum(len(b) for b in group.files.values())
    assert origin_bytes(group) >= size  # nothing of it was left anywhere in the group


def test_corrupted_bytes_from_a_peer_are_never_served(group, tmp_path):
    """A member whose answers are damaged on the way (a byte flipped after the checksum was set): the reader
    detects it, drops it and reads the bytes elsewhere."""
    from aiohttp import ClientSession, web

    real = group.ports["n2"]
    flipped = {"n": 0}

    async def proxy(request: web.Request) -> web.Response:
        async with ClientSession() as s, s.get(f"http://127.0.0.1:{real}{request.path_qs}",
                                               headers=request.headers) as r:
            body = bytearray(await r.read())
            headers = {k: v for k, v in r.headers.items() if k in (CHECKSUM_HEADER, "Content-Type")}
            if r.status == 200 and body and request.path.startswith(("/v1/block", "/v1/small")):
                body[len(body) // 2] ^= 0xFF
                flipped["n"] += 1
            return web.Response(status=r.status, body=bytes(body), headers=headers)

    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    port = _free_port()
    runner_of: list = [None]

    def serve():
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", proxy)
        runner = runner_of[0] = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        _read_through_the_damaging_proxy(group, tmp_path, port, flipped)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner_of[0].cleanup())
        loop.close()


def _read_through_the_damaging_proxy(group, tmp_path, port: int, flipped: dict) -> None:
    # n1 knows n2 only through the damaging proxy.
    group.procs["n1"].send_signal(signal.SIGTERM)
    group.procs["n1"].wait()
    group.procs.pop("n1")
    peers = f"n1=127.0.0.1:{group.ports['n1']},n2=127.0.0.1:{port},n3=127.0.0.1:{group.ports['n3']}"
    ready = tmp_path / "ready-n1"
    ready.unlink(missing_ok=True)
    group.procs["n1"] = subprocess.Popen(
        [sys.executable, "-m", "cachefs.cli.main", "agent", "--cache-dir", group.cache("n1"), "--group", "g1",
         "--node", "n1", "--listen", f"127.0.0.1:{group.ports['n1']}", "--peers", peers,
         "--serve", group.url.rsplit("/", 1)[0], "--secret-file", str(group.secret), "--ready-file", str(ready)],
        env=group.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)  # the members file rewritten with the proxy's address
    finish(group.read_all("n2"))  # n2 holds its keys
    assert finish(group.read_all("n1")) == expected(group.files)
    assert flipped["n"] > 0  # the damaged answers were sent, and none of them was served


def stored_block_bytes(cache_dir: str) -> int:
    """Bytes of large-file blocks on a node's disk (the sparse object files' allocated size)."""
    total = 0
    for root, _dirs, files in os.walk(os.path.join(cache_dir, "data")):
        total += sum(os.stat(os.path.join(root, f)).st_blocks * 512 for f in files)
    return total


def test_blocks_are_owned_once_in_the_group_and_readers_keep_the_rest_as_guests(group):
    """A node's agent keeps the blocks the node owns; with cluster.keep_guest off, readers keep nothing of what
    peers sent, so the group's disks hold one copy of a large file between them. With it on (the default),
    readers keep those blocks too, recorded as guest data (evicted first): only the owned ones are not guests."""
    env = {**group.env, "CACHEFS_CLUSTER_KEEP_GUEST": "0"}
    for n in group.names:
        proc = subprocess.Popen([sys.executable, "-c", READER, group.url, group.cache(n)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert finish(proc) == expected(group.files)
    big = sum(len(b) for p, b in group.files.items() if p.startswith("big/"))
    per_node = [stored_block_bytes(group.cache(n)) for n in group.names]
    assert big <= sum(per_node) < big + 3 * 3 * 4096, per_node  # one copy (plus the last blocks' page rounding)
    assert all(0 < s < big for s in per_node), per_node  # each holds its share, none the whole
    from cachefs.index import Index

    guests, _ = Index(group.cache("n1")).guests()
    assert not guests  # the agent's own blocks: none of them a guest
    guest_cache = str(group.tmp / "cache-guest-reader")
    os.makedirs(os.path.join(guest_cache, "cluster"))
    with open(os.path.join(group.cache("n1"), "cluster", "members.json")) as f:  # a reader on n1's node
        members = f.read()
    with open(os.path.join(guest_cache, "cluster", "members.json"), "w") as f:
        f.write(members)
    proc = subprocess.Popen([sys.executable, "-c", READER, group.url, guest_cache], env=group.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert finish(proc) == expected(group.files)
    assert stored_block_bytes(guest_cache) >= big
    index = Index(guest_cache)
    guests, guest_packs = index.guests()
    blocks = sum(len(index.blocks_of(okey)) for okey, _ in index.objects())
    assert 0 < sum(map(len, guests.values())) <= blocks and guest_packs  # what peers sent is recorded as guests


def test_a_refresh_on_one_node_is_taken_by_the_group(group):
    """`cachefs refresh` on one node lists the origin once and hands the new manifest to the members: readers
    on every node then see the new file, and no other node lists the origin."""
    for n in group.names:
        finish(group.read_all(n))
    group.server.client().put_object(Bucket=group.bucket, Key="ds/small/d0/new.txt", Body=b"added later")
    lists = group.server.requests()["lists"]
    out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "refresh", group.url, "--cache-dir",
                          group.cache("n1")], env=group.env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listed_by_refresh = group.server.requests()["lists"] - lists
    want = {**expected(group.files), "small/d0/new.txt": hashlib.sha256(b"added later").hexdigest()}
    for n in ("n2", "n3"):
        assert finish(group.read_all(n)) == want
    assert group.server.requests()["lists"] - lists == listed_by_refresh  # n2 and n3 listed nothing


#: Reads every file of one directory of the dataset ``rounds`` times over; prints their digests (the e2e tier too).
HOT_READER = r"""
import hashlib, json, sys
import fsspec
url, cache_dir, directory, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache_dir, dataset=url)
paths = sorted(fs.find(url + "/" + directory))
out = {}
for _ in range(rounds):
    for path in paths:
        with fs.open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        assert out.setdefault(path, digest) == digest, path
print(json.dumps({p[len(url.split("://", 1)[1]) + 1:]: d for p, d in out.items()}))
"""


def served(g: Group) -> dict[str, int]:
    from cachefs.status.summary import cluster_report

    time.sleep(2.5)  # (the agents write what they served every 2 s)
    return {n: cluster_report(g.cache(n))["served_requests"] for n in g.names}


def test_a_hot_directory_read_by_every_node_gains_replicas_and_its_owner_serves_less(tmp_path, s3):
    """One directory of small files (one placement window: one owner) read over and over by four nodes. Once it
    passes the hot threshold, its owner says so and readers spread over it and two replicas (the power of two
    choices); the replicas fetch from the owner, so the origin still sees one GET per file."""
    server, client, bucket = s3
    files = {f"hot/{i:03d}.bin": os.urandom(12_000 + i) for i in range(100)}
    put_tree(client, bucket, "ds", files)
    g = Group(tmp_path, server.env(), ["n1", "n2", "n3", "n4"], f"s3://{bucket}/ds")
    g.server, g.bucket = server, bucket
    g.env.update({"CACHEFS_CLUSTER_HOT_REQUESTS_PER_S": "20", "CACHEFS_CLUSTER_HOT_REPLICAS": "2",
                  # readers store nothing and keep 1 MiB of what peers send in memory: less than the directory,
                  # so every round asks the group again
                  "CACHEFS_CLUSTER_KEEP_GUEST": "0", "CACHEFS_ENGINE_MEMORY_BUDGET": str(8 << 20)})
    try:
        for n in g.names:
            g.start(n)
        server.requests(reset=True)

        def read(rounds: int) -> None:
            procs = [subprocess.Popen([sys.executable, "-c", HOT_READER, g.url, g.cache(n), "hot", str(rounds)],
                                      env=g.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for n in g.names]
            for p in procs:
                assert finish(p) == expected(files)  # every byte equal to the origin's

        from cachefs.cluster.keys import small_key
        from cachefs.cluster.placement import Placement, Weighted

        ranked = Placement([Weighted(n) for n in g.names]).owners(small_key(dataset_id(g.url), "hot/x", 0), 3)
        owner = ranked[0]
        before = served(g)
        read(1)  # cold, and not hot yet at first: the owner serves nearly all
        first = {n: v - before[n] for n, v in served(g).items()}
        read(10)
        after = {n: v - before[n] - first[n] for n, v in served(g).items()}
        assert first[owner] / sum(first.values()) > 0.6, first
        share = after[owner] / sum(after.values())
        assert share < 0.6, (share, after)  # about 0.45 (it also serves the replicas once); 1.0 unspread
        assert all(after[n] > 0.15 * sum(after.values()) for n in ranked[1:]), (ranked, after)
        print(f"owner {owner}: first pass {first}, ten more {after} (owner's share {share:.2f})")
        gets = dataset_gets(g)
        assert len(gets) == 100 and max(gets.values()) == 1, gets  # replicas fetched from the owner
        # status --json on the owner's node shows the hot directory and its replicas; so do its metrics.
        out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--json", "--cache-dir",
                              g.cache(owner)], env=g.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        hot = json.loads(out.stdout)["cluster"]["hot_keys"]
        assert [(k["directory"], k["replicas"], k["url"]) for k in hot] == [("hot", 2, g.url)], hot
        from cachefs.base.config import load_config
        from cachefs.status.collector import NodeCollector

        collector = NodeCollector(load_config(env={}, overrides={"cache_dir": g.cache(owner)}))
        metrics = {s.name: s for fam in collector.collect() for s in fam.samples}
        assert metrics["cachefs_hot_directories"].value == 1
        assert metrics["cachefs_hot_directory_replicas"].labels == {"dataset": dataset_id(g.url), "directory": "hot"}
        assert metrics["cachefs_hot_directory_replicas"].value == 2
    finally:
        g.stop()


def test_members_talk_tls_from_a_secret_and_refuse_plain_http_and_strangers(tmp_path, s3):
    """With the group's certificate, key and CA (from a Secret), members serve and ask over TLS with client
    certificates: readers get every byte right through it; plain HTTP, a client without the group's certificate
    and one with another CA's are refused; kubelet's probes (no certificate) still get /healthz."""
    import ssl

    from tests.integration.test_extender_lockdown import make_pki

    server, client, bucket = s3
    files = make_files()
    put_tree(client, bucket, "ds", files)
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    g = Group(tmp_path, server.env(), ["n1", "n2"], f"s3://{bucket}/ds")
    g.server, g.bucket = server, bucket
    g.agent_args = ["--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"),
                    "--tls-ca", str(pki / "ca.crt")]
    try:
        for n in g.names:
            g.start(n)
        server.requests(reset=True)
        for proc in [g.read_all(n) for n in g.names]:
            assert finish(proc) == expected(files)
        gets = dataset_gets(g)
        assert max(gets.values()) == 1, gets  # the group still fetched each block once: over TLS
        with open(os.path.join(g.cache("n1"), "cluster", "members.json")) as f:
            assert json.load(f)["tls"][2] == str(pki / "ca.crt")  # readers learn it from the members file
        port = g.ports["n2"]
        ds_path = f"/v1/info?x={dataset_id(g.url)}"
        # plain HTTP to the TLS port: no answer
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}{ds_path}", timeout=10)

        def https(path: str, cert: str | None) -> int:
            ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
            ctx.check_hostname = False
            if cert:
                ctx.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
            req = urllib.request.Request(f"https://127.0.0.1:{port}{path}",
                                         headers={"Authorization": "Bearer group-secret-1", MEMBER_HEADER: "n1"})
            try:
                with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
                    return resp.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert https(ds_path, "server") == 200  # the group's certificate and a member's secret
        assert https(ds_path, None) == 401  # no client certificate: refused though the secret is right
        assert https("/healthz", None) == 200  # (kubelet's probe)
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            https(ds_path, "stranger")  # another CA's certificate: the handshake fails
    finally:
        g.stop()

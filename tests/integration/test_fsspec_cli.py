"""The two front doors of the core: the fsspec protocol and the ``cachefs`` command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import fsspec
import pytest

from cachefs.index import Index
from cachefs.testing.s3server import S3Server
from tests.conftest import make_files, put_tree


def cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "cachefs.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture
def dataset(s3):
    _, client, bucket = s3
    files = make_files(n_small=40, big_sizes=(5_000_000,))
    put_tree(client, bucket, "ds", files)
    return f"s3://{bucket}/ds", files


def test_chained_url_reads_and_lists(dataset, cache_dir):
    url, files = dataset
    opts = {"cachefs": {"cache_dir": cache_dir, "dataset": url}}
    with fsspec.open(f"cachefs::{url}/big/0.bin", "rb", **opts) as f:
        assert f.read(10) == files["big/0.bin"][:10]
        f.seek(-5, 2)
        assert f.read() == files["big/0.bin"][-5:]
    fs, path = fsspec.core.url_to_fs(f"cachefs::{url}", **opts)
    assert sorted(fs.ls(path, detail=False)) == sorted([f"{path}/big", f"{path}/small"])
    assert len(fs.find(path)) == len(files)
    assert fs.info(f"{path}/big/0.bin")["size"] == 5_000_000
    assert fs.cat_file(f"{path}/small/d0/f0.txt") == files["small/d0/f0.txt"]
    with pytest.raises(FileNotFoundError):
        fs.info(f"{path}/nope")
    with pytest.raises(OSError):
        fs.open(f"{path}/new", "wb")


def test_pandas_and_pyarrow_read_through_cachefs(s3, cache_dir):
    import pandas as pd
    import pyarrow.parquet as pq

    _, client, bucket = s3
    df = pd.DataFrame({"a": range(1000), "b": [f"x{i}" for i in range(1000)]})
    client.put_object(Bucket=bucket, Key="tab/data.csv", Body=df.to_csv(index=False).encode())
    import io

    buf = io.BytesIO()
    df.to_parquet(buf)
    client.put_object(Bucket=bucket, Key="tab/data.parquet", Body=buf.getvalue())
    opts = {"cachefs": {"cache_dir": cache_dir, "dataset": f"s3://{bucket}/tab"}}
    got = pd.read_csv(f"cachefs::s3://{bucket}/tab/data.csv", storage_options=opts)
    assert got.equals(df)
    fs, path = fsspec.core.url_to_fs(f"cachefs::s3://{bucket}/tab/data.parquet", **opts)
    assert pq.read_table(path, filesystem=fs).to_pandas().equals(df)


def test_file_origin_through_fsspec(tmp_path, cache_dir):
    root = tmp_path / "origin"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "x.bin").write_bytes(b"x" * 100_000)
    (root / "top.txt").write_text("top")
    fs = fsspec.filesystem("cachefs", target_protocol="file", cache_dir=cache_dir, dataset=f"file://{root}")
    assert fs.cat_file(f"{root}/a/b/x.bin") == b"x" * 100_000
    assert fs.cat_file(f"{root}/top.txt") == b"top"
    assert sorted(fs.ls(str(root), detail=False)) == [f"{root}/a", f"{root}/top.txt"]


def test_prefetch_status_evict_refresh(dataset, cache_dir):
    url, files = dataset
    r = cli("prefetch", url, "--cache-dir", cache_dir, "--include", "small/*")
    assert r.returncode == 0, r.stderr
    assert "40/40 files" in r.stdout
    r = cli("status", "--cache-dir", cache_dir, "--json")
    rep = json.loads(r.stdout)
    (d,) = rep["datasets"]
    small = sum(len(v) for k, v in files.items() if k.startswith("small/"))
    assert d["cached_bytes"] == small and d["total_bytes"] == sum(map(len, files.values()))
    r = cli("prefetch", url, "--cache-dir", cache_dir)  # resumes: the small files are not fetched again
    assert r.returncode == 0, r.stderr
    assert f"{small} B already cached" in r.stdout or "already cached" in r.stdout
    assert json.loads(cli("status", "--cache-dir", cache_dir, "--json").stdout)["datasets"][0]["cached_fraction"] == 1.0
    table = cli("status", "--cache-dir", cache_dir).stdout
    assert url in table and "100.0%" in table
    r = cli("refresh", url, "--cache-dir", cache_dir)
    assert r.returncode == 0 and "manifest v2" in r.stdout
    r = cli("pin", url, "--cache-dir", cache_dir)  # kept from eviction on this node; an explicit evict still takes it
    assert r.returncode == 0 and "pinned on this node" in r.stdout, r.stderr
    assert json.loads(cli("status", "--cache-dir", cache_dir, "--json").stdout)["datasets"][0]["pinned_by"] == ["cli"]
    assert "pin,lru" in cli("status", "--cache-dir", cache_dir).stdout
    r = cli("evict", url, "--cache-dir", cache_dir)
    assert r.returncode == 0, r.stderr
    assert json.loads(cli("status", "--cache-dir", cache_dir, "--json").stdout)["used_bytes"] == 0
    r = cli("pin", "--remove", url, "--cache-dir", cache_dir)
    assert r.returncode == 0 and "no longer pinned" in r.stdout, r.stderr
    assert json.loads(cli("status", "--cache-dir", cache_dir, "--json").stdout)["datasets"][0]["pinned_by"] == []


@pytest.mark.parametrize(("args", "code", "words"), [
    (["prefetch", "not a url"], 2, "not a URL"),
    (["prefetch", "s3://"], 2, "no bucket"),
    (["prefetch", "s3://bucket/a/../b"], 2, "'..'"),
    (["prefetch", "nosuchscheme://x/y"], 2, "unknown scheme"),
    (["prefetch", "s3://cachefs-no-such-bucket/x"], 6, "not found"),
    (["evict"], 2, "--all"),
    (["prefetch", "s3://b/x", "--capacity", "lots"], 2, "capacity"),
])
def test_bad_input_is_one_clear_line(s3, cache_dir, args, code, words):
    r = cli(*args, "--cache-dir", cache_dir)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert words in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_unreachable_endpoint_and_missing_credentials(s3, cache_dir, tmp_path):
    r = cli("prefetch", "s3://b/x", "--cache-dir", cache_dir, "--endpoint-url", "http://127.0.0.1:9",
            env={"CACHEFS_ORIGIN_MAX_ATTEMPTS": "2"})
    assert r.returncode == 4 and "cannot reach" in r.stderr, r.stderr
    env = {k: "" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    r = subprocess.run([sys.executable, "-c", "import os,sys\n"
                        "[os.environ.pop(k) for k in ('AWS_ACCESS_KEY_ID','AWS_SECRET_ACCESS_KEY')]\n"
                        "from cachefs.cli.main import main; sys.exit(main(sys.argv[1:]))",
                        "prefetch", "s3://b/x", "--cache-dir", cache_dir],
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert r.returncode == 3 and "credentials" in r.stderr, r.stderr


def test_empty_dataset_and_zero_byte_and_odd_names(s3, cache_dir):
    _, client, bucket = s3
    client.put_object(Bucket=bucket, Key="odd/zero.bin", Body=b"")
    client.put_object(Bucket=bucket, Key="odd/with space/ünïcödé.txt", Body=b"u")
    client.put_object(Bucket=bucket, Key="odd/a/../escape.txt", Body=b"bad")
    client.put_object(Bucket=bucket, Key="odd/dir/", Body=b"")  # directory marker
    r = cli("prefetch", f"s3://{bucket}/odd", "--cache-dir", cache_dir)
    assert r.returncode == 0, r.stderr
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache_dir, dataset=f"s3://{bucket}/odd")
    assert fs.cat_file(f"{bucket}/odd/zero.bin") == b""
    assert fs.cat_file(f"{bucket}/odd/with space/ünïcödé.txt") == b"u"
    assert fs.info(f"{bucket}/odd/dir")["type"] == "directory"
    assert not fs.exists(f"{bucket}/odd/escape.txt") and not fs.exists(f"{bucket}/odd/a")
    rep = json.loads(cli("status", "--cache-dir", cache_dir, "--json").stdout)
    assert rep["datasets"][0]["skipped_names"] == 1
    client.create_bucket(Bucket=f"{bucket}-empty")
    r = cli("prefetch", f"s3://{bucket}-empty/nothing", "--cache-dir", cache_dir)  # a typo in a prefix, surely
    assert r.returncode == 6 and r.stderr.strip() == (f"cachefs: error: s3://{bucket}-empty/nothing: no objects "
                                                      "under this prefix (is the URL right?)"), r.stderr


def start_prefetch(url, cache_dir, env, workers, **popen):
    """``cachefs prefetch`` in the background."""
    return subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "prefetch", url, "--cache-dir", cache_dir,
                             "--workers", str(workers), "-q"], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def wait_cached(cache_dir, min_bytes, timeout=60):
    """Wait until the cache's index records more than ``min_bytes``."""
    deadline, index = time.time() + timeout, None
    while time.time() < deadline:
        time.sleep(0.05)
        if index is None and os.path.exists(os.path.join(cache_dir, "index")):
            index = Index(cache_dir)  # once: opening an index is not free, and a slow loop loses the race
        if index is not None and index.totals()[0] > min_bytes:
            return
    raise AssertionError(f"the cache never held more than {min_bytes} bytes within {timeout} s")


def test_kill_9_mid_prefetch_then_resume(s3, cache_dir):
    _, client, bucket = s3
    files = {f"k/f{i:03d}.bin": os.urandom(200_000) for i in range(120)}
    put_tree(client, bucket, "crash", files)
    url = f"s3://{bucket}/crash"
    env = {"CACHEFS_CACHE_BLOCK_SIZE": "65536", "CACHEFS_ENGINE_MAX_CONCURRENT_FETCHES": "2",
           "CACHEFS_CACHE_PACK_THRESHOLD": "0"}  # the block path; packs: tests/integration/test_packs.py
    proc = start_prefetch(url, cache_dir, env, workers=2)
    wait_cached(cache_dir, 2_000_000)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    partial = Index(cache_dir).totals()[0]
    total = sum(map(len, files.values()))
    assert 0 < partial < total, "kill landed after the prefetch finished; make the dataset larger"
    r = cli("prefetch", url, "--cache-dir", cache_dir, "--json", env=env)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    # resumed, not restarted: what the killed run cached (whole files at least) is not fetched again
    assert summary["bytes_skipped"] > 0
    assert summary["bytes_fetched"] == total - summary["bytes_skipped"]
    assert summary["files_done"] == len(files)
    # every cached byte verifies against the origin
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache_dir, dataset=url, skip_instance_cache=True)
    for path, data in files.items():
        assert fs.cat_file(f"{bucket}/crash/{path}") == data


def test_many_threads_open_a_fresh_dataset_at_once(dataset, cache_dir):
    """Regression: 16 threads racing to take the first manifest must not starve the event loop's executor."""
    from concurrent.futures import ThreadPoolExecutor

    url, files = dataset
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache_dir, dataset=url, skip_instance_cache=True)
    names = sorted(k for k in files if k.startswith("small/"))

    def read(name):
        with fs.open(f"{url[5:]}/{name}", "rb") as f:
            return f.read() == files[name]

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(read, names, timeout=60))


READER = """
import sys, fsspec, hashlib
url, cache_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache_dir, dataset=url)
for _ in range(3):
    for n in names:
        print(n, hashlib.sha256(fs.cat_file(url[5:] + "/" + n)).hexdigest())
"""


def test_several_processes_share_one_cache(dataset, cache_dir):
    import hashlib

    url, files = dataset
    names = sorted(files)
    procs = [subprocess.Popen([sys.executable, "-c", READER, url, cache_dir, *names[i::2] + names[::3]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        for line in out.splitlines():
            name, digest = line.split()
            assert digest == hashlib.sha256(files[name]).hexdigest()
    rep = json.loads(cli("status", "--cache-dir", cache_dir, "--json").stdout)
    assert rep["datasets"][0]["cached_bytes"] == sum(map(len, files.values()))


def _interrupts_at_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def test_ctrl_c_mid_prefetch_exits_130_and_keeps_what_was_cached(cache_dir):
    """An origin that answers every request 25 ms late, and one fetch at a time: the 200 files take 20 s at
    least, so the interrupt arrives mid-run however fast or slow the machine (this test once lost the race: the
    prefetch had finished before the signal came)."""
    with S3Server(delay_ms=25) as slow:
        client = slow.client()
        client.create_bucket(Bucket="intr")
        files = {f"i/f{i:03d}.bin": os.urandom(200_000) for i in range(200)}
        put_tree(client, "intr", "ds", files)
        url = "s3://intr/ds"
        env = {**slow.env(), "CACHEFS_CACHE_BLOCK_SIZE": "65536", "CACHEFS_ENGINE_MAX_CONCURRENT_FETCHES": "1",
               "CACHEFS_CACHE_PACK_THRESHOLD": "0"}  # the block path, one GET at a time
        # As from a shell's foreground: SIGINT at its default. (In one full-suite run the child started with SIGINT
        # and SIGQUIT ignored, inherited from the test worker; this test is about the CLI, not about the worker.)
        proc = start_prefetch(url, cache_dir, env, workers=1, text=True, preexec_fn=_interrupts_at_default)
        wait_cached(cache_dir, 1_000_000)
        with open(f"/proc/{proc.pid}/status") as f:
            masks = [line.strip() for line in f if line.startswith(("SigBlk", "SigIgn"))]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (out, err, masks)
        assert "interrupted" in err and "resume" in err and "Traceback" not in err
        env["CACHEFS_ENGINE_MAX_CONCURRENT_FETCHES"] = "64"
        r = cli("prefetch", url, "--cache-dir", cache_dir, "--json", env=env)
        summary = json.loads(r.stdout)
        assert summary["bytes_skipped"] > 1_000_000 and summary["files_done"] == len(files)


def test_labels_command_prints_the_contract():
    r = cli("labels", "s3://bucket/imagenet", "--cached", "900GB", "--total", "1TB", "--cache-group", "rack-7")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    from cachefs.base.types import dataset_id

    key = f"ds.cachefs.io/{dataset_id('s3://bucket/imagenet')}"
    assert out["labels"][key] == "90" and out["labels"]["cachefs.io/cache-group"] == "rack-7"
    assert json.loads(out["annotations"][key])["totalBytes"] == 10**12
    bad = cli("labels", "s3://bucket/x", "--cached", "1", "--total", "2", "--cache-group", "no spaces allowed")
    assert bad.returncode == 2 and "label value" in bad.stderr


def test_scheduler_extender_command_serves_http():
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "scheduler-extender", "--standalone",
                             "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    assert r.read() == b"ok"
                break
            except OSError:
                assert time.time() < deadline, "extender did not start"
                time.sleep(0.2)
        body = json.dumps({"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": [{"metadata": {"name": "a"}}]}})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/prioritize", data=body.encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read()) == [{"Host": "a", "Score": 0}]
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_scheduler_extender_without_cluster_access_says_so(tmp_path):
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "scheduler-extender", "--listen", "127.0.0.1:18999"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "no Kubernetes API access" in out.stderr and "Traceback" not in out.stderr


def _read_in_child(url: str, options: dict, out) -> None:
    with fsspec.open(url, "rb", **options) as f:
        out.put(f.read())


def test_forked_workers_read_through_the_parents_filesystem_and_keep_what_they_read(s3, cache_dir):
    """DataLoader workers are forked after the parent has used cachefs (its loop thread and LMDB handles do not
    survive fork): each child opens its own engine, and what it read is in the cache when it exits (it ends in
    os._exit, so its pending packs are written by a multiprocessing finalizer), as the parent's re-read shows."""
    import multiprocessing as mp

    server, client, bucket = s3
    files = make_files(n_small=20, big_sizes=())
    put_tree(client, bucket, "ds", files)
    url = f"s3://{bucket}/ds"
    options = {"cachefs": {"cache_dir": cache_dir}}
    fs, root = fsspec.core.url_to_fs(f"cachefs::{url}", **options)
    assert len(fs.find(root)) == len(files)  # the parent's loop and engine are running now
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    names = sorted(n for n in files if n.startswith("small/"))[:6]
    children = [ctx.Process(target=_read_in_child, args=(f"cachefs::{url}/{n}", options, out)) for n in names]
    for child in children:
        child.start()
    got = sorted(out.get(timeout=60) for _ in children)
    for child in children:
        child.join(30)
        assert child.exitcode == 0, "a forked reader hung or failed"
    assert got == sorted(files[n] for n in names)
    server.requests(reset=True)
    assert [fs.cat_file(f"{root}/{n}") for n in names] == [files[n] for n in names]
    assert not [k for k in server.requests()["gets"] if "/small/" in k], "the children's reads were not kept"


def test_the_order_command_computes_a_declared_samplers_orders(s3, cache_dir):
    """``cachefs order URL --sampler ...``: every rank's order of the epoch, computed from the dataset's listing
    (cachefs.prefetch.samplers), as the job's DistributedSampler will read it; bad specs are one line."""
    from cachefs.base.types import DatasetRef
    from cachefs.index.orders import list_orders, read_order
    from cachefs.prefetch.samplers import parse_sampler, sampler_files, sampler_orders

    _, client, bucket = s3
    files = {f"train/c{i % 3}/{i:03d}.jpg": b"x" for i in range(30)} | {"train/README": b"r", "val/0.jpg": b"v"}
    put_tree(client, bucket, "ds", files)
    url = f"s3://{bucket}/ds"
    text = "torch-distributed:seed=5,world-size=4,ranks=0-3,under=train,match=*.jpg"
    r = cli("order", url, "--sampler", text, "--epoch", "2", "--cache-dir", cache_dir)
    assert r.returncode == 0, r.stderr
    assert "4 rank(s), 30 files" in r.stdout
    spec = parse_sampler(text)
    want = sampler_orders(sampler_files(files, spec), spec, 2)
    got = {f.publisher: read_order(f.path) for f in list_orders(cache_dir, DatasetRef.from_url(url).id)}
    assert got == {f"sampler-r{rank}": (2, want[rank]) for rank in range(4)}
    # (every sample once, and two again: 30 padded to 32, a multiple of the world size, as DistributedSampler pads)
    assert {p for order in want.values() for p in order} == {p for p in files if p.startswith("train/c")}
    assert sum(map(len, want.values())) == 32
    r = cli("order", url, "--sampler", "torch-distributed:under=nowhere", "--cache-dir", cache_dir)
    assert r.returncode == 2 and "no file under 'nowhere'" in r.stderr and "Traceback" not in r.stderr

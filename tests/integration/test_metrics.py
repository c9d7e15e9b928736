"""Metrics as Prometheus sees them: a real mount and ``cachefs metrics`` (the node's endpoint), and the scheduler
extender, scraped over HTTP and parsed with prometheus-client's own parser; after a known workload the counters
hold what it did."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefs.base.config import load_config
from tests.conftest import put_tree
from tests.integration.test_fsspec_cli import cli

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample at ``url``: (sample name, sorted label items) → value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_for(url: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            samples = scrape(url)
            if check(samples):
                return samples
        except OSError:
            samples = None
        assert time.monotonic() < deadline, samples
        time.sleep(0.3)


def _drop_page_cache() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


_COUNTING = r"""
import os, sys
from cachefs.base.metrics import CORRUPT_READS
CORRUPT_READS.labels("block").inc(int(sys.argv[1]))
print("counted", flush=True)
if sys.argv[2] == "hang":  # alive until the test closes our stdin; each line it sends: count again
    for _ in sys.stdin:
        CORRUPT_READS.labels("block").inc(int(sys.argv[1]))
        print("counted", flush=True)
elif sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)  # no exit handlers: its files stay as a crash leaves them
"""


def _count_in_process(d: Path, n: int, how: str, *, namespace: bool = False) -> subprocess.Popen:
    """A process that adds ``n`` to a counter in the metrics directory ``d`` and then exits, is killed, or hangs;
    with ``namespace``, in a pid namespace of its own (as each container of the node pod is), where it is pid 1."""
    argv = [sys.executable, "-c", _COUNTING, str(n), how]
    if namespace:
        argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    return subprocess.Popen(argv, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d)}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)


@pytest.mark.root
def test_the_metrics_directory_keeps_counts_of_dead_processes_in_one_file_and_same_pids_apart(tmp_path):
    """Processes of the node's containers share one metrics directory: two live pid-1 processes of two pid
    namespaces count apart (they used to write into one counter_1.db), and the files of the dead (exited or
    killed) are folded into one archive at the next scrape, so the directory does not grow with every process
    ever run (it kept 99 files of dead processes after an afternoon) and no count is lost."""
    from cachefs.status.server import node_registry

    d = tmp_path / "metrics"
    d.mkdir()
    hanging = [_count_in_process(d, n, "hang", namespace=True) for n in (3, 4)]
    try:
        for p in hanging:
            assert p.stdout.readline().strip() == "counted"
        config = load_config(env={}, overrides={"cache_dir": str(tmp_path / "cache")})
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(d)
        try:
            def total() -> float:
                registry = node_registry(config)
                return registry.get_sample_value("cachefs_corrupt_reads_total", {"kind": "block"})
            for p in hanging:  # both are pid 1, in namespaces of their own: they count apart
                p.stdin.write("again\n")
                p.stdin.flush()
                assert p.stdout.readline().strip() == "counted"
            assert total() == 2 * (3 + 4)
            for n, how in ((10, "exit"), (20, "kill"), (30, "exit"), (40, "kill")):
                p = _count_in_process(d, n, how)
                assert p.communicate(timeout=30)[0].strip() == "counted" and p.returncode in (0, -9)
            assert total() == 2 * (3 + 4) + 10 + 20 + 30 + 40
            left = sorted(p.name for p in d.glob("counter_*.db"))
            assert len(left) == 3 and "counter_archive.db" in left, left  # the two live ones and the archive
            for mode in ("livesum", "livemax"):  # the live processes' live gauges only
                assert len(list(d.glob(f"gauge_{mode}_*.db"))) == 2, mode
            for p in hanging:
                p.communicate(timeout=30)
                assert p.returncode == 0
            assert total() == 2 * (3 + 4) + 10 + 20 + 30 + 40  # still, with everything archived
            assert sorted(p.name for p in d.glob("*.db")) == ["counter_archive.db"]
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    finally:
        for p in hanging:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.root
def test_a_mount_and_the_node_endpoint_count_what_a_known_workload_did(s3, tmp_path):
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse (CI runs as root)")
    from tests.integration.test_fuse import Mounted

    _, client, bucket = s3
    n = 30
    files = {f"d/{i:03d}.bin": os.urandom(2000 + i) for i in range(n)}
    put_tree(client, bucket, "m", files)
    total = sum(len(d) for d in files.values())
    url, cache, mnt = f"s3://{bucket}/m", str(tmp_path / "cache"), str(tmp_path / "mnt")
    os.mkdir(mnt)
    env = {"CACHEFS_METRICS_DIR": str(tmp_path / "metrics"), "CACHEFS_ENGINE_STATS_FLUSH_INTERVAL": "0.5"}
    m = Mounted(cache, url, mnt, "--no-prefill", "--keep-opens", env=env)
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "metrics", "--listen", f"127.0.0.1:{port}",
                               "--cache-dir", cache], env={**os.environ, **env}, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}/metrics"
    try:
        before = _wait_for(endpoint, lambda s: True)
        gets0 = value(before, "cachefs_origin_requests_total", kind="get", result="ok")
        for rel, data in files.items():  # cold: each file one GET (some of them ahead of its reader)
            with open(m.path(rel), "rb") as f:
                assert f.read() == data
        # (a file read to its end takes one or two READs: wait for the opens too, which count files)
        cold = _wait_for(endpoint, lambda s: value(s, "cachefs_read_bytes_total", kind="small", result="miss")
                         >= total and value(s, "cachefs_fuse_requests_total", op="read", result="ok") >= n
                         # (a flush adds the request counts, then their times: a scrape may fall in between)
                         and value(s, "cachefs_fuse_request_duration_seconds_count", op="read") >= n
                         and value(s, "cachefs_fuse_opens_total", mode="userspace") >= n
                         and value(s, "cachefs_dataset_read_bytes_total", dataset=url, result="miss") >= total)
        assert value(cold, "cachefs_origin_requests_total", kind="get", result="ok") - gets0 == n
        assert value(cold, "cachefs_read_bytes_total", kind="small", result="miss") == total
        assert value(cold, "cachefs_read_bytes_total", kind="small", result="hit") == 0
        assert value(cold, "cachefs_tier_bytes_total", tier="origin") == total
        assert value(cold, "cachefs_dataset_read_bytes_total", dataset=url, result="miss") == total  # the index
        assert value(cold, "cachefs_fuse_opens_total", mode="userspace") == n
        assert value(cold, "cachefs_fuse_request_duration_seconds_count", op="read") == \
            value(cold, "cachefs_fuse_requests_total", op="read", result="ok")
        assert value(cold, "cachefs_origin_request_duration_seconds_count", kind="get") - gets0 >= n
        assert value(cold, "cachefs_mounts", state="serving") == 1

        _drop_page_cache()
        for rel, data in files.items():  # warm: N hits, no GET
            with open(m.path(rel), "rb") as f:
                assert f.read() == data
        # (the files' pack is written within a second of their fetch: the cache's used bytes follow it; the
        # per-dataset figures come from the index, flushed every half second, after the live counters)
        warm = _wait_for(endpoint, lambda s: value(s, "cachefs_read_bytes_total", kind="small", result="hit") >= total
                         and value(s, "cachefs_cache_used_bytes") >= total
                         and value(s, "cachefs_dataset_read_bytes_total", dataset=url, result="hit") >= total
                         and value(s, "cachefs_dataset_cached_bytes", dataset=url) >= total)
        assert value(warm, "cachefs_read_bytes_total", kind="small", result="hit") == total
        assert value(warm, "cachefs_origin_requests_total", kind="get", result="ok") - gets0 == n
        assert value(warm, "cachefs_dataset_read_bytes_total", dataset=url, result="hit") == total
        assert value(warm, "cachefs_tier_bytes_total", tier="local") == total
        assert value(warm, "cachefs_cache_used_bytes") >= total and value(warm, "cachefs_dataset_cached_bytes",
                                                                          dataset=url) == total

        # cachefs status reads the same counters
        rep = json.loads(cli("status", "--cache-dir", cache, "--json", env=env).stdout)
        assert rep["tier_bytes"]["origin"] == total and rep["tier_bytes"]["local"] == total
        (d,) = rep["datasets"]
        assert d["hit_bytes"] == total and d["miss_bytes"] == total
    finally:
        server.terminate()
        server.wait(10)
        m.close()


def test_the_extender_counts_its_requests_by_verb_and_status(tmp_path):
    from tests.integration.test_extender import args, node, pod

    port, metrics_port = _port(), _port()
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "scheduler-extender", "--standalone",
                             "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics_port}"],
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        _wait_for(endpoint, lambda s: True)
        deadline = time.monotonic() + 30  # the extender's own port may open a moment after the metrics port
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the extender did not listen"
                time.sleep(0.05)
        body = json.dumps(args(pod("p1", gpus=1), [node("a"), node("b")])).encode()
        for verb, data, times in (("filter", body, 3), ("prioritize", body, 2), ("filter", b"{not json", 1)):
            for _ in range(times):
                req = urllib.request.Request(f"http://127.0.0.1:{port}/{verb}", data=data, method="POST")
                try:
                    urllib.request.urlopen(req, timeout=10).read()
                except urllib.error.HTTPError as exc:
                    assert exc.code == 400
        s = scrape(endpoint)
        assert value(s, "cachefs_extender_requests_total", verb="filter", code="200") == 3
        assert value(s, "cachefs_extender_requests_total", verb="prioritize", code="200") == 2
        assert value(s, "cachefs_extender_requests_total", verb="filter", code="400") == 1
        assert value(s, "cachefs_extender_request_duration_seconds_count", verb="filter") == 4
    finally:
        proc.terminate()
        proc.wait(10)


def test_docs_list_every_metric():
    """docs/METRICS.md names every metric the code defines (counters with their ``_total``), and no other."""
    from prometheus_client.metrics import MetricWrapperBase

    import cachefs.base.metrics
    import scheduler_hints.metrics

    expect = set()
    for module in (cachefs.base.metrics, scheduler_hints.metrics):
        for obj in vars(module).values():
            if isinstance(obj, MetricWrapperBase):
                expect.add(obj._name + "_total" if obj._type == "counter" else obj._name)
    node = (ROOT / "src" / "cachefs" / "status" / "collector.py").read_text()
    expect |= {n + "_total" for n in re.findall(r'CounterMetricFamily\(\s*"(cachefs_\w+)"', node)}
    expect |= set(re.findall(r'GaugeMetricFamily\(\s*"(cachefs_\w+)"', node))
    expect |= set(re.findall(r'\("(cachefs_cache_\w+)", "', node))  # the node's gauges, named in one tuple
    doc = set(re.findall(r"`(cachefs_[a-z_]+)`", (ROOT / "docs" / "METRICS.md").read_text()))
    assert doc == expect, (sorted(doc - expect), sorted(expect - doc))

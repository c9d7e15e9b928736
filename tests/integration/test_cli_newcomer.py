"""What a newcomer trips over in the CLI: each mistake gets its exit code and one clear line, nothing else
(the table in docs/CLI.md; a real S3 server on loopback)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import put_tree
from tests.integration.test_fsspec_cli import cli


def _one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), r.stderr
    assert "Traceback" not in r.stderr and "Unclosed" not in r.stderr
    return lines[0]


@pytest.fixture
def small(s3):
    _, client, bucket = s3
    put_tree(client, bucket, "data", {"a.bin": os.urandom(1000), "b/c.bin": os.urandom(2000)})
    return bucket


@pytest.mark.parametrize("argv, rc, says", [
    (["prefetch", "s3://Bad_Bucket!!"], 2, "not a valid S3 bucket name"),
    (["prefetch", "s3://{bucket}/data", "--endpoint-url", "htp:/bad"], 2, "--endpoint-url"),
    (["prefetch", "http://127.0.0.1:1/y"], 4, "cannot reach the origin"),
    (["prefetch", "s3://{bucket}/nope"], 6, "no objects under this prefix"),
    (["prefetch", "s3:/data"], 2, "not a URL"),
    (["prefetch", "s3://{bucket}/data", "--capacity", "lots"], 2, "cache.capacity"),
    (["evict"], 2, "give a dataset URL or --all"),
])
def test_mistakes_get_their_exit_code_and_one_line(small, tmp_path, argv, rc, says):
    argv = [a.replace("{bucket}", small) for a in argv]
    r = cli(*argv, "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == rc, (r.returncode, r.stderr)
    assert says in _one_line(r)


def test_an_aws_endpoint_that_is_not_a_url_is_one_line(small, tmp_path):
    r = cli("prefetch", f"s3://{small}/data", "--cache-dir", str(tmp_path / "c"), env={"AWS_ENDPOINT_URL": "htp:/bad"})
    assert r.returncode == 2 and "AWS_ENDPOINT_URL" in _one_line(r), r.stderr


@pytest.mark.root
def test_a_read_only_cache_directory_is_named(small, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        r = cli("prefetch", f"s3://{small}/data", "--cache-dir", str(ro / "cache"))
        assert r.returncode == 2
        line = _one_line(r)
        assert "--cache-dir" in line and "Read-only file system" in line, line
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_status_and_evict_of_a_cache_that_is_not_there_create_nothing(tmp_path):
    typo = tmp_path / "var" / "cache" / "typo"
    for argv in (["status"], ["status", "--json"], ["evict", "--all"]):
        r = cli(*argv, "--cache-dir", str(typo))
        assert r.returncode == 6 and f"no cache at {typo}" in _one_line(r)
    assert not (tmp_path / "var").exists()


def test_version_and_help(tmp_path):
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("cachefs ") and r.stdout.split()[1][0].isdigit()
    top = cli("--help").stdout
    assert "exit codes:" in top and "6  not found" in top and "CACHEFS_CACHE_DIR" in top and "AWS_ENDPOINT_URL" in top
    umount = cli("umount", "--help").stdout
    status = cli("status", "--help").stdout
    prefetch = cli("prefetch", "--help").stdout
    for flag in ("--capacity", "--endpoint-url", "--memory-budget", "--region"):
        assert flag not in umount and flag not in status and flag in prefetch, flag
    # (umount takes the cache directory: a writable mount's uploads are waited for there first)
    assert "--cache-dir" in status and "--cache-dir" in umount and "--no-sync" in umount


def test_prefetch_progress_counts_bytes_as_they_land_and_ends_with_one_line(s3, tmp_path):
    """Off a tty the progress is a line every few seconds; the last one is printed once, at 100 %."""
    _, client, bucket = s3
    put_tree(client, bucket, "prog", {f"f{i}.bin": os.urandom(3_000_000) for i in range(3)})
    r = cli("prefetch", f"s3://{bucket}/prog", "--cache-dir", str(tmp_path / "c"),
            env={"CACHEFS_CACHE_BLOCK_SIZE": "65536"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[")]
    assert lines[-1].count("100.0%") == 1 and sum("100.0%" in ln for ln in lines) == 1, lines
    assert "ETA 00:00" in lines[-1]
    assert "3/3 files" in r.stdout


def test_hit_ratio_means_what_users_think(s3, tmp_path):
    """A purely cold read is all misses (read-ahead that arrived in time included); reading again is all hits;
    a prefetched dataset is read as hits."""
    import fsspec

    _, client, bucket = s3
    files = {"big.bin": os.urandom(2_000_000)} | {f"d/{i:03d}.txt": os.urandom(3000) for i in range(60)}
    put_tree(client, bucket, "hits", files)
    url, cache = f"s3://{bucket}/hits", str(tmp_path / "c")
    opts = dict(target_protocol="s3", cache_dir=cache, dataset=url, skip_instance_cache=True,
                cache_block_size=65536)

    def ratio() -> float:
        (d,) = json.loads(cli("status", "--cache-dir", cache, "--json").stdout)["datasets"]
        return d["hit_ratio"]

    fs = fsspec.filesystem("cachefs", **opts)
    for rel, data in files.items():  # in order, as a reader walks a tree: read-ahead runs ahead of it
        with fs.open(f"{bucket}/hits/{rel}", "rb") as f:
            assert b"".join(iter(lambda: f.read(100_000), b"")) == data
    fs.engine.flush_stats()
    assert ratio() < 0.05
    for rel, data in files.items():
        assert fs.cat_file(f"{bucket}/hits/{rel}") == data
    fs.engine.flush_stats()
    assert 0.45 < ratio() < 0.55  # as many hit bytes now as there were misses before

    cache2 = str(tmp_path / "c2")
    assert cli("prefetch", url, "--cache-dir", cache2, "-q", env={"CACHEFS_CACHE_BLOCK_SIZE": "65536"}).returncode == 0
    fs2 = fsspec.filesystem("cachefs", **{**opts, "cache_dir": cache2})
    for rel, data in files.items():
        assert fs2.cat_file(f"{bucket}/hits/{rel}") == data
    fs2.engine.flush_stats()
    (d,) = json.loads(cli("status", "--cache-dir", cache2, "--json").stdout)["datasets"]
    assert d["hit_ratio"] == 1.0


@pytest.mark.parametrize("argv, rc, says", [
    (["mount", "ftp://127.0.0.1:1/ds", "{mnt}"], 4, "cannot reach the origin"),
    (["mount", "gs://bucket/ds", "{mnt}"], 2, "backend is not installed (Please install gcsfs"),
    (["mount", "sftp://"], 2, ""),  # (argparse: the mount point is missing)
])
def test_a_url_a_backend_refuses_is_one_line(tmp_path, argv, rc, says):
    """ftp:// printed a Python traceback (the file system wants its host, which the URL carries); gs:// without
    gcsfs said '(None)'."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = cli(*[a.replace("{mnt}", str(mnt)) for a in argv], "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == rc, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    if says:
        assert says in _one_line(r)


def test_a_mount_over_a_directory_with_files_is_refused_unless_asked_for(small, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (mnt / "precious.txt").write_text("hidden by a mount until unmounted")
    r = cli("mount", f"s3://{small}/data", str(mnt), "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 2 and "is not empty" in _one_line(r) and "--nonempty" in r.stderr
    assert (mnt / "precious.txt").read_text().startswith("hidden")


def test_a_busy_metrics_port_is_named_with_exit_2(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("metrics", "--listen", f"127.0.0.1:{port}", "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 2 and f"127.0.0.1:{port}" in _one_line(r), r.stderr


@pytest.mark.parametrize("secret, extra, says", [
    ("/nonexistent/secret", [], "No such file or directory"),
    ("{empty}", [], "empty"),
    ("{secret}", ["--token-file", "{secret}"], "both given"),
])
def test_agent_credentials_that_cannot_work_stop_it_at_start(tmp_path, secret, extra, says):
    """A missing or empty secret file, or a secret and a token together, used to start an agent whose peers then
    answered 401."""
    (tmp_path / "empty").write_text("")
    (tmp_path / "secret").write_text("s3cret\n")

    def fill(a: str) -> str:
        return a.replace("{empty}", str(tmp_path / "empty")).replace("{secret}", str(tmp_path / "secret"))

    r = cli("agent", "--group", "g", "--node", "n1", "--listen", "127.0.0.1:1", "--peers", "n1=127.0.0.1:1",
            "--cache-dir", str(tmp_path / "cache"), "--secret-file", fill(secret), *map(fill, extra), timeout=60)
    assert r.returncode == 2 and says in _one_line(r), r.stderr


def test_a_second_agent_on_one_cache_directory_is_refused_naming_the_first(tmp_path):
    import socket
    import sys
    import time

    (tmp_path / "secret").write_text("s3cret\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--group", "g", "--peers", f"n1=127.0.0.1:{port}", "--cache-dir", str(tmp_path / "cache"),
              "--secret-file", str(tmp_path / "secret")]
    ready = tmp_path / "ready"
    first = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "agent", "--node", "n1", "--listen",
                              f"127.0.0.1:{port}", "--ready-file", str(ready), *common],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.05)
        r = cli("agent", "--node", "n1", "--listen", "127.0.0.1:1", *common, timeout=60)
        assert r.returncode == 2 and f"pid {first.pid}" in _one_line(r) and "--cache-dir" in r.stderr
        assert first.poll() is None  # the first one is untouched
    finally:
        first.terminate()
        _, err = first.communicate(timeout=30)
    assert "cannot write" not in err  # (the members file's first write)


def test_the_next_node_pods_agent_takes_the_cache_directory_over_and_the_first_stands_by(tmp_path):
    """A rolling update starts the next node pod while the current one serves: its agent (a node pod generation,
    $CACHEFS_NODE_GENERATION) claims the cache directory instead of being refused; the first agent hands it over and
    stands by, serves again if the newcomer goes first, and leaves at once when stopped while standing by."""
    import os
    import socket
    import sys
    import time

    (tmp_path / "secret").write_text("s3cret\n")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    common = ["--group", "g", "--node", "n1", "--peers", f"n1=127.0.0.1:{ports[0]}", "--cache-dir",
              str(tmp_path / "cache"), "--secret-file", str(tmp_path / "secret")]

    def agent(gen: str, port: int, ready, log) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "agent", "--listen", f"127.0.0.1:{port}",
                                 "--ready-file", str(ready), *common], stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, "CACHEFS_NODE_GENERATION": gen})

    def until(check, what: str) -> None:
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    ready_a, ready_b = tmp_path / "ready-a", tmp_path / "ready-b"
    log_a = open(tmp_path / "a.log", "w")
    a = agent("gen-a", ports[0], ready_a, log_a)
    b = None
    try:
        until(ready_a.exists, "the first agent never became ready")
        b = agent("gen-b", ports[1], ready_b, subprocess.DEVNULL)
        until(ready_b.exists, "the next generation's agent never got the cache directory")
        assert a.poll() is None  # standing by, not gone
        ready_a.unlink()
        b.terminate()
        assert b.wait(30) == 0
        until(ready_a.exists, "the standing-by agent did not serve again once the newcomer was gone")
        b = agent("gen-c", ports[1], ready_b := tmp_path / "ready-c", subprocess.DEVNULL)
        until(ready_b.exists, "a third generation's agent never got the cache directory")
        t0 = time.monotonic()
        a.terminate()  # standing by now: it leaves at once
        assert a.wait(30) == 0 and time.monotonic() - t0 < 10
        assert b.poll() is None
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(30)
        log_a.close()
    err = (tmp_path / "a.log").read_text()
    assert err.count("handing it over") == 2 and "standing by" in err, err

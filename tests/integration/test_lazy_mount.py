"""A mount answers before its dataset's first listing finishes (issue 45): directories are listed as readers ask,
the full manifest is taken meanwhile and then served, and a walk of 100,000 files stays within the memory budget.

The origin is the synthetic S3 endpoint (objects computed from their numbers, every byte checkable); one directory's
listing is held until the test lets it go, so the first listing cannot finish while the mount is checked: no timing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from cachefs.manifest.lazy import is_provisional
from cachefs.testing.synthetic_s3 import SyntheticBucket, content, running
from tests.integration.test_fuse import Mounted

pytestmark = pytest.mark.root

N = 100_000
HELD = "d000099/"  # the last directory: the background listing cannot finish without it
BUDGET = 512 * 2**20  # engine.memory_budget's default: the daemon and its holder together stay under it


@pytest.fixture(scope="module")
def synthetic():
    with running("--objects", str(N), "--hold-prefix", HELD) as endpoint:
        yield endpoint


def _env(endpoint: str) -> dict:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "synthetic", "AWS_SECRET_ACCESS_KEY": "synthetic",
            "AWS_REGION": "us-east-1"}


def _server(endpoint: str, what: str) -> dict:
    req = urllib.request.Request(f"{endpoint}/_synthetic/{what}", method="POST" if what == "release" else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def _status(cache: str, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--cache-dir", cache, "--json"],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _datasets(cache: str, env: dict) -> list[dict]:
    return _status(cache, env)["datasets"]


def _check(path: str, key: str) -> None:
    i = SyntheticBucket(N).number(key)
    assert i is not None
    with open(path, "rb") as f:
        assert f.read() == content(i, 0, SyntheticBucket.size(i)), key


def _tree_rss(pid: int) -> int:
    out = subprocess.run(["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)], capture_output=True, text=True)
    return sum(int(x) for x in out.stdout.split()) * 1024


def test_a_mount_serves_its_tree_before_the_first_listing_ends_then_the_manifest(synthetic, tmp_path):
    bucket, env = SyntheticBucket(N), _env(synthetic)
    cache, mnt = str(tmp_path / "cache"), str(tmp_path / "mnt")
    os.mkdir(mnt)
    m = Mounted(cache, "s3://synthetic", mnt, env=env)
    try:
        assert len(os.listdir(mnt)) == bucket.dirs  # the root, listed on demand
        deadline = time.monotonic() + 60
        while _server(synthetic, "requests")["held"] == 0:  # the first listing reaches the held directory
            assert time.monotonic() < deadline, "the first listing never started"
            time.sleep(0.05)
        assert _datasets(cache, env) == []  # ... and no manifest is committed: it cannot finish
        deadline = time.monotonic() + 30
        while not (listings := _status(cache, env)["listings"]):  # its progress, written about once a second
            assert time.monotonic() < deadline, "no listing in cachefs status"
            time.sleep(0.2)
        assert [li["url"] for li in listings] == ["s3://synthetic"] and 0 < listings[0]["files"] < N
        rng = random.Random(7)
        for i in rng.sample(range(N - bucket.per_dir), 20):  # files looked up directly: a HEAD each
            key = bucket.key(i)
            assert os.stat(m.path(key)).st_size == bucket.size(i)
            _check(m.path(key), key)
        some_dir = bucket.key(12_345).split("/")[0]
        names = sorted(os.listdir(m.path(some_dir)))  # one directory's listing
        assert names == [bucket.key(i).split("/")[1] for i in range(12_000, 13_000)]
        missing = f"{some_dir}/f9999999999.bin"
        assert not os.path.exists(m.path(missing)) and not os.path.exists(m.path("nosuchdir/x"))
        with pytest.raises(NotADirectoryError):
            os.listdir(m.path(bucket.key(5)))

        # A daemon killed while the first listing runs: the next one lists again as it is read, and the inodes the
        # kernel holds still name the same files.
        held_open = open(m.path(bucket.key(12_345)), "rb")  # (open across the restart)
        daemon = m.wait_for_daemon()
        os.kill(daemon["pid"], signal.SIGKILL)
        m.wait_for_daemon(other_than=daemon["pid"])
        i = 12_345
        assert held_open.read() == content(i, 0, SyntheticBucket.size(i))
        held_open.close()
        assert sorted(os.listdir(m.path(some_dir))) == names
        _check(m.path(bucket.key(54_321)), bucket.key(54_321))
        assert _datasets(cache, env) == []  # (still held)

        _server(synthetic, "release")
        deadline = time.monotonic() + 120
        while not _datasets(cache, env):  # the manifest lands once the held listing answers
            assert time.monotonic() < deadline, "the first listing never finished"
            time.sleep(0.2)
        (ds,) = _datasets(cache, env)
        assert ds["manifest_versions"] == [1] and ds["files"] == N
        assert _status(cache, env)["listings"] == []  # done: its record is gone
        journal_version = None
        deadline = time.monotonic() + 30
        while journal_version != 1:  # the mount serves the manifest now: its next daemon will open that one
            assert time.monotonic() < deadline, journal_version
            journal_version = _served_version(cache, mnt)
            time.sleep(0.1)

        # The provisional entries go once the dataset settled: the killed daemon's too (its lock is free).
        from cachefs.base.types import DatasetRef
        from cachefs.index import Index
        from cachefs.manifest import ManifestStore

        store, ds_id = ManifestStore(Index(cache)), DatasetRef.from_url("s3://synthetic").id
        deadline = time.monotonic() + 60
        while (versions := store.versions(ds_id)) != [1]:
            assert time.monotonic() < deadline, versions
            time.sleep(0.2)

        walked = 0
        for d, _, files in os.walk(mnt):  # what ImageFolder does: every directory, a stat of every file
            for name in files:
                os.stat(os.path.join(d, name))
                walked += 1
        assert walked == N
        _check(m.path(bucket.key(N - 1)), bucket.key(N - 1))  # in the directory that was held
        rss = _tree_rss(m.proc.pid)
        assert 0 < rss < BUDGET, rss
    finally:
        m.close()


def _served_version(cache: str, mnt: str) -> int | None:
    from cachefs.fuse.journal import replay
    from cachefs.index.mounts import mount_file

    init = replay(mount_file(cache, mnt, ".journal")).init
    version = init["manifest_version"] if init else None
    return None if version is None or is_provisional(version) else version


FLAT = 3_000  # three LIST pages, a dozen directory pages, some seventy READDIR answers


@pytest.fixture(scope="module")
def flat_origin():
    with running("--objects", "0", "--flat", str(FLAT)) as endpoint:
        yield endpoint


def test_a_flat_directory_is_read_in_pages_across_a_daemon_restart(flat_origin, tmp_path):
    """One directory of 3,000 objects, listed on demand and read by READDIR a page at a time: every name once, in
    order; a daemon killed while the directory is open leaves the reader's handle to the next one, which reads on
    from the kernel's offset."""
    bucket, env = SyntheticBucket(0, flat=FLAT), _env(flat_origin)
    want = [bucket.key(i).split("/")[1] for i in range(FLAT)]
    cache, mnt = str(tmp_path / "cache"), str(tmp_path / "mnt")
    os.mkdir(mnt)
    m = Mounted(cache, "s3://synthetic", mnt, env=env)
    try:
        with os.scandir(m.path("flat")) as it:  # (the first read of it: every page is a READDIR to the daemon)
            seen = [next(it).name for _ in range(100)]
            daemon = m.wait_for_daemon()
            os.kill(daemon["pid"], signal.SIGKILL)
            m.wait_for_daemon(other_than=daemon["pid"])
            seen += [e.name for e in it]
        assert seen == want  # (READDIR order: the manifest's, by name)
        assert os.listdir(m.path("flat")) == want
        for i in (0, FLAT // 2, FLAT - 1):
            assert os.stat(m.path(bucket.key(i))).st_size == bucket.size(i)
            with open(m.path(bucket.key(i)), "rb") as f:
                assert f.read() == content(i, 0, bucket.size(i)), bucket.key(i)
    finally:
        m.close()

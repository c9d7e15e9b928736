"""Fixtures shared by every tier.

The S3 origin is moto's real server (HTTP on a loopback port chosen by the kernel, in its own process),
started once per session and reset before each test that uses it, the way s3fs's and zarr's suites do. An
ephemeral port keeps parallel runs from colliding.
"""

from __future__ import annotations

import os
import uuid

import pytest

from cachefs.base.config import load_config
from cachefs.testing.s3server import S3Server


@pytest.fixture(scope="session")
def s3_server():
    with S3Server() as server:
        yield server


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A clean S3 origin: ``(server, boto3 client, bucket name)``; env points the AWS chain at it."""
    s3_server.reset()
    return with_new_bucket(s3_server, monkeypatch)


def with_new_bucket(server, monkeypatch):
    """``(server, boto3 client, a new bucket)`` of a test S3 server; env points the AWS chain (and the cachefs CLI)
    at it."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    client = server.client()
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return server, client, bucket


@pytest.fixture
def cache_dir(tmp_path):
    d = tmp_path / "cache"
    return str(d)


@pytest.fixture
def config(cache_dir):
    """A config for tests: small blocks so multi-block paths run on small files, files up to 16 KiB packed (small
    packs, so that tests see several), quick retries."""
    return load_config(env={}, overrides={
        "cache_dir": cache_dir,
        "cache_block_size": 64 * 1024,
        "cache_pack_threshold": 16 * 1024,
        "cache_pack_size": 256 * 1024,
        "cache_min_free": "0",
        "origin_backoff_base": 0.001,
        "origin_backoff_max": 0.01,
        "origin_request_timeout": 5.0,
        "engine_memory_budget": 8 * 1024 * 1024,
    })


def put_tree(client, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=f"{prefix}/{kv[0]}", Body=kv[1]),
                      files.items()))


def make_files(n_small: int = 20, big_sizes: tuple[int, ...] = (300_000,), seed: int = 1) -> dict[str, bytes]:
    import random

    rng = random.Random(seed)
    files = {f"big/{i}.bin": rng.randbytes(s) for i, s in enumerate(big_sizes)}
    for i in range(n_small):
        files[f"small/d{i % 3}/f{i}.txt"] = rng.randbytes(rng.randint(0, 5000))
    return files


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (util-linux fincore: mincore on a mapping, which reads nothing)."""
    import subprocess

    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", path],
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip() or 0)


def pytest_configure(config):
    import tempfile

    os.environ.setdefault("CACHEFS_TEST", "1")
    # The metrics files of the cachefs processes tests start (mounts, CSI) go here, not into /run.
    os.environ.setdefault("CACHEFS_METRICS_DIR", tempfile.mkdtemp(prefix="cachefs-test-metrics-"))
    # Which caches this user has (cachefs.index.caches) is noted under XDG_STATE_HOME: the tests' own, not the
    # user's, so that a command given no --cache-dir finds only caches the tests made.
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="cachefs-test-state-")


#: Test files that drop or measure the kernel's page cache: run one after another on one worker (under
#: pytest-xdist), never beside each other, since a drop in one would change what another measures.
PAGE_CACHE_FILES = {"tests/integration/test_metrics.py", "tests/integration/test_fuse.py",
                    "tests/integration/test_packs.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups off the items
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs two workers with ``--dist loadgroup``) a file's tests run on one
    worker, in order, so its module fixtures are made once; the page-cache files share one group, and so do the
    end-to-end files, which share the session's control plane (one per worker that runs any)."""
    for item in items:
        path = item.nodeid.split("::")[0]
        group = "page-cache" if path in PAGE_CACHE_FILES else "e2e" if path.startswith("tests/e2e/") else path
        item.add_marker(pytest.mark.xdist_group(group))

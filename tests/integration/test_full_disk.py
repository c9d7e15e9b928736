"""A cache on a small, real filesystem (tmpfs mounted for the test): full disks give clear errors and never
corrupt what is cached."""

from __future__ import annotations

import json
import os
import subprocess

import fsspec
import pytest

from tests.conftest import put_tree
from tests.integration.test_fsspec_cli import cli

pytestmark = pytest.mark.root


@pytest.fixture
def tiny_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (CI runs as root)")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("pack_threshold", ["0", "1MiB"], ids=["blocks", "packs"])
def test_full_disk_prefetch_fails_clearly_and_reads_still_work(s3, tiny_fs, pack_threshold):
    _, client, bucket = s3
    files = {f"f{i}.bin": os.urandom(400_000) for i in range(12)}  # 4.8 MB into a 3 MB filesystem
    put_tree(client, bucket, "full", files)
    url = f"s3://{bucket}/full"
    cache = os.path.join(tiny_fs, "cache")
    # capacity and floor deliberately above what the disk has, so eviction cannot save the day
    env = {"CACHEFS_CACHE_CAPACITY": "100MB", "CACHEFS_CACHE_MIN_FREE": "0", "CACHEFS_CACHE_BLOCK_SIZE": "65536",
           "CACHEFS_CACHE_PACK_THRESHOLD": pack_threshold}
    r = cli("prefetch", url, "--cache-dir", cache, "--workers", "1", env=env)
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "full" in r.stderr and "Traceback" not in r.stderr
    # everything that was cached verifies, and reading through the cache still works (bypassing the full disk)
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache, dataset=url, skip_instance_cache=True,
                           cache_capacity="100MB", cache_min_free="0", cache_block_size=65536,
                           cache_pack_threshold=pack_threshold)
    for name, data in files.items():
        assert fs.cat_file(f"{bucket}/full/{name}") == data
    rep = json.loads(cli("status", "--cache-dir", cache, "--json", env=env).stdout)
    assert 0 < rep["used_bytes"] < 3 * 1024 * 1024


def test_capacity_from_watermarks_keeps_disk_usable(s3, tiny_fs):
    _, client, bucket = s3
    files = {f"f{i}.bin": os.urandom(300_000) for i in range(15)}
    put_tree(client, bucket, "wm", files)
    url = f"s3://{bucket}/wm"
    cache = os.path.join(tiny_fs, "cache")
    env = {"CACHEFS_CACHE_CAPACITY": "1500KB", "CACHEFS_CACHE_BLOCK_SIZE": "65536", "CACHEFS_CACHE_MIN_FREE": "5%"}
    for name in files:
        r = cli("prefetch", url, "--cache-dir", cache, "--include", name, "-q", env=env)
        assert r.returncode == 0, r.stderr
    rep = json.loads(cli("status", "--cache-dir", cache, "--json", env=env).stdout)
    assert rep["used_bytes"] <= rep["capacity_bytes"]
    assert rep["disk_free_bytes"] >= rep["min_free_bytes"]


def test_full_disk_under_a_mirror_prefetch_fails_clearly_and_leaves_no_half_pack(s3, tiny_fs, tmp_path):
    _, client, bucket = s3
    files = {f"d/f{i:02d}.bin": os.urandom(400_000) for i in range(12)}  # one 4.8 MB mirror pack, a 3 MB disk
    put_tree(client, bucket, "mfull", files)
    url = f"s3://{bucket}/mfull"
    r = cli("pack", url, "--cache-dir", str(tmp_path / "packer"))
    assert r.returncode == 0, r.stderr
    cache = os.path.join(tiny_fs, "cache")
    env = {"CACHEFS_CACHE_CAPACITY": "100MB", "CACHEFS_CACHE_MIN_FREE": "0"}
    r = cli("prefetch", url, "--cache-dir", cache, env=env)
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "full" in r.stderr and "Traceback" not in r.stderr
    left = [n for _d, _s, names in os.walk(os.path.join(cache, "packs")) for n in names]
    assert left == []  # the temp file of the pack that did not fit is gone
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache, dataset=url, skip_instance_cache=True,
                           cache_capacity="100MB", cache_min_free="0")
    for name, data in files.items():
        assert fs.cat_file(f"{bucket}/mfull/{name}") == data

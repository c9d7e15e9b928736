"""FUSE over io_uring, for real: the fuse module's enable_uring switched on, a mount that asks for the ring, the
kernel as the client (root tier; skipped on kernels without the module parameter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachefs.fuse.uring import possible_cpus
from cachefs.testing.waiting import wait_for
from tests.conftest import make_files, put_tree
from tests.integration.test_fuse import Mounted

pytestmark = pytest.mark.root

PARAM = "/sys/module/fuse/parameters/enable_uring"

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse (CI runs as root)", allow_module_level=True)


@pytest.fixture
def enable_uring():
    """The fuse module's io_uring switch, on or off for one test and put back after."""
    if not os.path.exists(PARAM):
        pytest.skip("this kernel's fuse module has no io_uring (Linux 6.14+, CONFIG_FUSE_IO_URING)")
    with open(PARAM) as f:
        before = f.read().strip()

    def switch(on: bool) -> None:
        with open(PARAM, "w") as f:
            f.write("Y\n" if on else "N\n")

    yield switch
    with open(PARAM, "w") as f:
        f.write(before + "\n")


@pytest.fixture
def dataset(s3):
    _, client, bucket = s3
    files = make_files(n_small=80, big_sizes=(3_000_000, 700_001))
    put_tree(client, bucket, "ds", files)
    return f"s3://{bucket}/ds", files


def read_all(m: Mounted, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        with open(m.path(rel), "rb") as f:
            assert f.read() == data, rel


def test_a_mount_that_asks_for_io_uring_serves_every_request_type_through_the_ring(enable_uring, dataset, cache_dir,
                                                                                 tmp_path):
    enable_uring(True)
    url, files = dataset
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, url, str(mnt), "--io-uring", "auto", "--no-passthrough")
    try:
        listed = {os.path.relpath(os.path.join(d, n), mnt) for d, _, names in os.walk(mnt) for n in names}
        assert listed == set(files)
        read_all(m, files)  # cold: fetched while the ring waits
        for rel, data in files.items():
            assert os.stat(m.path(rel)).st_size == len(data)
        read_all(m, files)  # warm
        stats = wait_for(lambda: (s := (m.record() or {}).get("stats", {})).get("io_uring_requests") and s,
                         what="the daemon's count of ring requests")
        assert stats["io_uring_queues"] == possible_cpus()
        assert stats["io_uring_requests"] >= len(files)  # at least a LOOKUP per file came through the ring
        out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--cache-dir", cache_dir],
                             capture_output=True, text=True, check=True).stdout
        assert f"io_uring ({possible_cpus()} queues)" in out
    finally:
        m.close()


def test_without_the_module_switch_the_same_mount_serves_through_dev_fuse(enable_uring, dataset, cache_dir, tmp_path):
    enable_uring(False)
    url, files = dataset
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, url, str(mnt), "--io-uring", "auto")
    try:
        read_all(m, files)
        rec = wait_for(lambda: (r := m.record()) and r.get("mode") not in (None, "starting") and r,
                       what="the mount record")
        assert not rec["stats"].get("io_uring_queues")
    finally:
        m.close()

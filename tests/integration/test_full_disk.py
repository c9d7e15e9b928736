"""A cache on a small, real filesystem (tmpfs mounted for the test): full disks give clear errors and never
corrupt what is cached."""

from __future__ import annotations

import json
import os
import subprocess
import time

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


# -- through the mount, with real clients ------------------------------------------------------------------------

def _real_files(tmp_path) -> dict[str, bytes]:
    """A sqlite database, a zip archive, a parquet file and a plain large file, as a dataset would hold them."""
    import random
    import sqlite3
    import zipfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(7)
    db = tmp_path / "src.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, blob BLOB)")
    con.executemany("INSERT INTO t VALUES (?, ?, ?)", ((i, f"row {i}", rng.randbytes(200)) for i in range(8000)))
    con.execute("CREATE INDEX t_name ON t(name)")
    con.commit()
    con.close()
    zpath = tmp_path / "src.zip"
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_STORED) as z:
        for i in range(20):
            z.writestr(f"member{i}.bin", rng.randbytes(60_000))
    ppath = tmp_path / "src.parquet"
    pq.write_table(pa.table({"x": list(range(100_000)), "y": [rng.random() for _ in range(100_000)]}), ppath,
                   compression="none")
    return {"db/data.sqlite": db.read_bytes(), "zips/archive.zip": zpath.read_bytes(),
            "tables/part-0.parquet": ppath.read_bytes(), "raw/large.bin": rng.randbytes(12_000_000)}


def _index_is_consistent(cache: str) -> None:
    """Every block and packed member the index lists is on disk with the checksum recorded; the totals add up."""
    from cachefs.base.checksum import block_checksum
    from cachefs.index import Index
    from cachefs.index.records import pack_key
    from cachefs.store import DiskStore
    from cachefs.store.pack_store import DiskPackStore

    index = Index(cache)
    store, packs = DiskStore(cache, 1), DiskPackStore(cache)
    total = 0
    for okey, rec in index.objects():
        blocks = index.blocks_of(okey)
        assert sum(length for _, length in blocks.values()) == rec.cached_bytes
        with open(store.object_path(okey, rec.dataset), "rb") as f:
            for i, (checksum, length) in blocks.items():
                f.seek(i * rec.block_size)
                assert block_checksum(f.read(length)) == checksum, (rec.path, i)
        total += rec.cached_bytes
    for prec in index.packs():
        assert os.path.exists(packs.pack_path(prec.dataset, prec.pack_id))
        total += prec.size
    assert index.totals()[0] == total
    with index.env.begin() as txn:  # every packed member's bytes verify in its pack
        for okey, _ in txn.cursor(db=index._packed):
            pack_id, offset, length, checksum = index.packed(bytes(okey))
            ds = next(p.dataset for p in index.packs() if p.pack_id == pack_id)
            with open(packs.pack_path(ds, pack_id), "rb") as f:
                f.seek(offset)
                assert block_checksum(f.read(length)) == checksum
            assert pack_key(ds, pack_id)


@pytest.mark.parametrize("size", ["5m", "24m"])
def test_reads_through_the_mount_on_a_full_cache_disk_are_right(s3, tmp_path, size):
    """A cache disk far too small (5 MiB: nothing fits twice; 24 MiB: a file larger than the cache): every client
    reads the origin's bytes, sqlite's integrity check passes, the limits hold, the index stays consistent, and
    the mount's statistics keep being published."""
    import sqlite3
    import zipfile

    import pyarrow.parquet as pq

    from tests.integration.test_fuse import Mounted

    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    _, client, bucket = s3
    files = _real_files(tmp_path)
    put_tree(client, bucket, "real", files)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    cache, mnt = str(disk / "cache"), str(tmp_path / "mnt")
    os.mkdir(mnt)
    m = Mounted(cache, f"s3://{bucket}/real", mnt, env={"CACHEFS_CACHE_LOG_DIR": str(tmp_path / "logs")})
    try:
        for _ in range(2):  # the second pass reads what the first one could keep, the rest from the origin
            for rel, data in files.items():
                r = subprocess.run(["cmp", "-", m.path(rel)], input=data, capture_output=True, timeout=300)
                assert r.returncode == 0, (rel, r.stdout, r.stderr)
        con = sqlite3.connect(f"file:{m.path('db/data.sqlite')}?mode=ro&immutable=1", uri=True)
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert con.execute("SELECT count(*), sum(length(blob)) FROM t").fetchone() == (8000, 8000 * 200)
        con.close()
        with zipfile.ZipFile(m.path("zips/archive.zip")) as z:
            assert z.testzip() is None and len(z.namelist()) == 20
        assert pq.read_table(m.path("tables/part-0.parquet")).num_rows == 100_000
        before = m.stats()["userspace_read_bytes"]
        with open(m.path("raw/large.bin"), "rb") as f:
            f.read(1_000_000)
        assert m.stats()["userspace_read_bytes"] > before or m.record()["mode"] == "passthrough"
        rep = json.loads(cli("status", "--cache-dir", cache, "--json").stdout)
        assert rep["used_bytes"] <= rep["capacity_bytes"]
        assert rep["disk_free_bytes"] >= rep["min_free_bytes"] * 0.5, rep  # the floor (a log line may take a page)
        assert m.proc.poll() is None
        _index_is_consistent(cache)
    finally:
        m.close()
        subprocess.run(["umount", "-l", str(disk)], check=False)
    log = m.output
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]


def test_an_idle_mounted_dataset_can_be_evicted_and_an_open_file_is_kept(s3, tmp_path):
    from tests.integration.test_fuse import Mounted

    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    _, client, bucket = s3
    files = {f"big{i}.bin": os.urandom(3_000_000) for i in range(4)} | {f"s/{i}.txt": os.urandom(5000) for i in range(50)}
    put_tree(client, bucket, "ev", files)
    url, cache, mnt = f"s3://{bucket}/ev", str(tmp_path / "cache"), str(tmp_path / "mnt")
    os.mkdir(mnt)
    m = Mounted(cache, url, mnt)
    try:
        for rel, data in files.items():
            with open(m.path(rel), "rb") as f:
                assert f.read() == data
        for rel in files:  # now whole in the cache: opened again, passthrough
            with open(m.path(rel), "rb") as f:
                f.read(10)
        deadline = time.monotonic() + 30  # the small files' pack is written a second after the last one
        while json.loads(cli("status", "--cache-dir", cache, "--json").stdout)["used_bytes"] < \
                sum(len(d) for d in files.values()):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        with open(m.path("big0.bin"), "rb") as held:  # a reader has this one open now
            r = cli("evict", url, "--cache-dir", cache)
            assert r.returncode == 0, r.stderr
            left = json.loads(cli("status", "--cache-dir", cache, "--json").stdout)["used_bytes"]
            assert left <= 3_000_000, r.stdout  # everything but the file held open
            assert left >= 3_000_000 - 1, r.stdout
            assert held.read() == files["big0.bin"][:]
        for rel, data in files.items():  # and the mount reads on (from the origin again)
            with open(m.path(rel), "rb") as f:
                assert f.read() == data
    finally:
        m.close()


def _fill(path: str) -> str:
    """Fill the file system of ``path`` to its last block; returns the filler file (remove it to undo)."""
    filler = os.path.join(path, "filler")
    with open(filler, "wb", buffering=0) as f:
        for piece in (65536, 4096, 1):
            try:
                while f.write(b"\0" * piece) == piece:
                    pass
            except OSError:
                pass
    return filler


def test_the_index_commits_on_a_full_disk_by_spending_its_reserve(tiny_fs):
    from cachefs.base.errors import CacheFullError
    from cachefs.index import Index
    from cachefs.index.records import ObjectRecord

    cache = os.path.join(tiny_fs, "cache")
    index = Index(cache)
    st = os.statvfs(tiny_fs)
    assert index.keep_reserve(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize) and index.reserve.present()
    filler = _fill(tiny_fs)
    rec = ObjectRecord("ds", "p", "v", 1 << 30, block_size=65536)
    okey = bytes(range(16))
    committed = 0
    with pytest.raises(CacheFullError):  # a full disk is a full disk, never an lmdb error
        for i in range(200_000):
            index.put_block(okey, i, i, 65536, rec)
            committed += 1
    assert committed > 0 and not index.reserve.present()  # the reserve let commits through, then ran out
    assert len(index.blocks_of(okey)) == committed  # nothing half-written
    os.unlink(filler)
    assert index.remove_object(okey) == committed * 65536
    st = os.statvfs(tiny_fs)
    assert index.keep_reserve(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize) and index.reserve.present()


def test_the_mount_journal_and_inode_table_go_on_in_memory_when_the_disk_is_full(tiny_fs):
    from cachefs.fuse.inode_table import InodeTable
    from cachefs.fuse.journal import MountJournal, replay

    path = os.path.join(tiny_fs, "j", "mount.journal")
    journal = MountJournal.start(path)
    journal.init("passthrough", 1, 1)
    table = InodeTable(os.path.join(tiny_fs, "j", "mount.inodes"))
    (first, _), = table.looked_up([("before/the-disk-filled", "")])
    filler = _fill(tiny_fs)
    for ino in range(2, 20_000):  # far past what the preallocated space holds
        journal.backing(ino, ino)
    got = table.looked_up([(f"dir/file-{i:08d}", "") for i in range(200_000)])  # far past a page or two
    assert journal.degraded and len(journal.state.backing) == 20_000 - 2
    assert table.degraded and len(table) == 200_001
    assert table.get(got[-1][0]).path == "dir/file-00199999" and table.get(first).path == "before/the-disk-filled"
    journal.close()
    table.close()
    assert replay(path).init == {"mode": "passthrough", "flags": 1, "manifest_version": 1}  # what was written reads
    os.unlink(filler)


@pytest.mark.parametrize("run", range(4))
def test_a_prefetch_onto_a_full_disk_never_ends_in_a_traceback(s3, tiny_fs, run):
    """Many fetches in flight when the disk fills: the engine stops them and lets their writes finish before it
    closes its files (it used to close them under running writes: 'Bad file descriptor' tracebacks)."""
    _, client, bucket = s3
    files = {f"f{i}.bin": os.urandom(300_000) for i in range(16)}
    put_tree(client, bucket, "tb", files)
    env = {"CACHEFS_CACHE_CAPACITY": "100MB", "CACHEFS_CACHE_MIN_FREE": "0", "CACHEFS_CACHE_BLOCK_SIZE": "65536",
           "CACHEFS_CACHE_PACK_THRESHOLD": "0"}
    r = cli("prefetch", f"s3://{bucket}/tb", "--cache-dir", os.path.join(tiny_fs, "cache"), "--workers", "16", "-q",
            env=env)
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1].startswith("cachefs: error: cache disk full"), r.stderr
    assert "Traceback" not in r.stderr and "Bad file descriptor" not in r.stderr and "ERROR" not in r.stderr, r.stderr

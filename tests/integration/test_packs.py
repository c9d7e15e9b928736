"""Small files in pack files: the same bytes on every path (engine, fsspec, after a restart, after eviction,
after a corrupted member), crash safety of pack writing (a real SIGKILL at the worst moments), directory
read-ahead, and hot-directory counters."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import fsspec
import pytest

from cachefs.base.config import load_config
from cachefs.base.types import object_key
from cachefs.engine import Engine, ReadStream
from cachefs.index import Index
from cachefs.status.summary import status_report
from cachefs.store import pack_store as packs_module
from tests.conftest import resident_bytes


@pytest.fixture
def tree(tmp_path):
    """A local origin (file://): 3 directories of small files and one large file."""
    root = tmp_path / "origin"
    rng = __import__("random").Random(7)
    files = {f"train/c{i % 3}/{i:04d}.jpg": rng.randbytes(rng.randint(0, 12_000)) for i in range(150)}
    files["big.bin"] = rng.randbytes(200_000)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return f"file://{root}", root, files


def run(engine: Engine, coro):
    async def main():
        try:
            return await coro
        finally:
            await engine.aclose()
    return asyncio.run(main())


async def read_all(engine: Engine, url: str, files: dict[str, bytes]) -> dict[str, bytes]:
    ds = await engine.open_dataset(url)
    return {rel: await engine.read(ds, ds.file(rel), 0, len(data) + 10, ReadStream()) for rel, data in files.items()}


def test_small_files_are_packed_and_read_back_the_same_everywhere(tree, config):
    url, root, files = tree
    engine = Engine(config)
    assert run(engine, read_all(engine, url, files)) == files
    index = Index(config.cache.dir)
    packs = list(index.packs())
    small = {rel: d for rel, d in files.items() if len(d) <= config.cache.pack_threshold}
    nonempty = {rel: d for rel, d in small.items() if d}  # empty files need no bytes stored anywhere
    assert len(packs) >= 2 and sum(p.members for p in packs) == len(nonempty)
    data_files = [f for _dirs, _sub, names in os.walk(os.path.join(config.cache.dir, "data")) for f in names]
    assert len(data_files) == len(files) - len(small)  # only the large file got a file of its own
    # A pack is an Arrow IPC file anyone can read: path, version, checksum, data.
    import pyarrow as pa

    seen = {}
    for p in packs:
        table = pa.ipc.open_file(pa.memory_map(packs_module.DiskPackStore(config.cache.dir).pack_path(
            p.dataset, p.pack_id))).read_all()
        assert table.column_names == ["path", "version", "checksum", "data"]
        seen.update(zip(table.column("path").to_pylist(), table.column("data").to_pylist(), strict=True))
    assert seen == nonempty

    # A new process (engine) reads them back from the packs alone: the origin is gone.
    os.rename(root, str(root) + ".gone")
    engine = Engine(config)
    assert run(engine, read_all(engine, url, small)) == small
    # fsspec, too
    fs = fsspec.filesystem("cachefs", target_protocol="file", cache_dir=config.cache.dir, dataset=url,
                           skip_instance_cache=True, cache_pack_threshold=config.cache.pack_threshold,
                           cache_block_size=config.cache.block_size)
    for rel, data in small.items():
        assert fs.cat_file(f"{root}/{rel}") == data


def _drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_one_member_reads_only_itself_and_a_swept_pack_is_read_ahead_whole(tree, config):
    url, _root, files = tree
    engine = Engine(config)
    run(engine, read_all(engine, url, files))
    index = Index(config.cache.dir)
    pack = max(index.packs(), key=lambda p: p.members)
    path = packs_module.DiskPackStore(config.cache.dir).pack_path(pack.dataset, pack.pack_id)
    size = os.path.getsize(path)
    import pyarrow as pa

    members = pa.ipc.open_file(pa.memory_map(path)).read_all().column("path").to_pylist()
    _drop_from_page_cache(path)  # as after a reboot
    assert len(members) >= 4 and resident_bytes(path) == 0

    async def read(rels):
        ds = await engine.open_dataset(url)
        return [await engine.read(ds, ds.file(rel), 0, len(files[rel]), ReadStream()) for rel in rels]

    engine = Engine(config)
    assert run(engine, read(members[:1])) == [files[members[0]]]
    one = resident_bytes(path)
    assert 0 < one <= len(files[members[0]]) + 2 * 4096 < size  # that member's pages, not the device's read-ahead
    engine = Engine(config)
    assert run(engine, read(members[:3])) == [files[m] for m in members[:3]]
    deadline = time.monotonic() + 10
    while resident_bytes(path) < size and time.monotonic() < deadline:  # the read-ahead is asynchronous
        time.sleep(0.05)
    assert resident_bytes(path) >= size - 4096


def test_eviction_removes_whole_packs_and_files_come_back(tree, config):
    url, _root, files = tree
    engine = Engine(config)
    run(engine, read_all(engine, url, files))
    index = Index(config.cache.dir)
    pack_files = sorted(os.listdir(os.path.join(config.cache.dir, "packs", next(index.packs()).dataset)))
    assert pack_files and all(n.endswith(".arrow") for n in pack_files)
    engine = Engine(config)
    freed = engine.purge_sync()
    engine.close()
    assert freed > 0 and list(index.packs()) == [] and index.totals() == (0, 0)
    assert not any(n.endswith(".arrow") for _d, _i, n in packs_module.DiskPackStore(config.cache.dir).files())
    engine = Engine(config)
    assert run(engine, read_all(engine, url, files)) == files


def test_a_pack_evicted_by_another_process_is_closed_here_and_its_files_come_back(tree, config):
    """A reader keeps pack descriptors open; another process evicting the pack must not leave its space held
    by them, and the files must come back from the origin."""
    url, _root, files = tree
    small = {r: d for r, d in files.items() if r.startswith("train/")}
    engine = Engine(config)

    async def scenario():
        assert await read_all(engine, url, small) == small
        await engine.packs.pending.flush()
        ds = await engine.open_dataset(url)
        for rel, data in small.items():  # from the packs now: their descriptors are kept
            assert engine.read_local(ds, ds.file(rel), 0, len(data)) == data
        other = Engine(config)  # another process's eviction
        assert other.purge_sync() > 0
        other.close()
        assert engine.packs.reads.close_unlinked() >= 1
        assert engine.packs.reads.close_unlinked() == 0
        for rel, data in small.items():
            assert engine.read_local(ds, ds.file(rel), 0, len(data)) == (None if data else b"")  # gone here
        return await read_all(engine, url, small)

    assert run(engine, scenario()) == small


def test_a_corrupted_member_is_detected_and_fetched_again(tree, config, caplog):
    url, _root, files = tree
    engine = Engine(config)
    run(engine, read_all(engine, url, files))
    index = Index(config.cache.dir)
    ds_id = next(index.packs()).dataset
    rel = next(r for r, d in files.items() if 100 < len(d) <= config.cache.pack_threshold)
    pack_id, offset, length, _ck = index.packed(object_key(ds_id, rel, _version(url, rel, config)))
    path = packs_module.DiskPackStore(config.cache.dir).pack_path(ds_id, pack_id)
    with open(path, "r+b") as f:  # one flipped byte in the middle of the member
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    engine = Engine(config)
    with caplog.at_level(logging.WARNING):
        got = run(engine, read_all(engine, url, {rel: files[rel]}))
    assert got[rel] == files[rel]
    assert "failed its checksum" in caplog.text
    new = index.packed(object_key(ds_id, rel, _version(url, rel, config)))
    assert new is not None and new[0] != pack_id  # re-fetched into a new pack


def _version(url: str, rel: str, config) -> str:
    engine = Engine(config)

    async def get():
        ds = await engine.open_dataset(url)
        return ds.file(rel).version
    return run(engine, get())


CRASH = textwrap.dedent("""
    import asyncio, os, signal, sys
    from cachefs.base.config import load_config
    from cachefs.engine import Engine
    from cachefs.store import pack_store as packs
    from cachefs.index import index as index_module
    url, cache, where = sys.argv[1:4]
    if where == "mid-write":  # half the pack's bytes reach the temp file, then the process dies
        real_pwrite = os.pwrite
        def pwrite(fd, data, offset):
            real_pwrite(fd, bytes(data[: len(data) // 2]), offset)
            os.kill(os.getpid(), signal.SIGKILL)
        packs.os.pwrite = pwrite
    else:  # the pack is complete and renamed, the process dies before the index learns of it
        def commit(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        index_module.Index.commit_pack = commit
    config = load_config(env={}, overrides={"cache_dir": cache})
    engine = Engine(config)
    async def main():
        ds = await engine.open_dataset(url)
        for e in ds.walk_files():
            await engine.ensure_cached(ds, e)
        await engine.persist()
    asyncio.run(main())
""")


@pytest.mark.parametrize("where", ["mid-write", "after-rename"])
def test_a_crash_while_writing_a_pack_never_serves_it_and_leaves_nothing_behind(tree, cache_dir, where, monkeypatch):
    url, _root, files = tree
    proc = subprocess.run([sys.executable, "-c", CRASH, url, cache_dir, where], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    leftovers = os.listdir(os.path.join(cache_dir, "packs", os.listdir(os.path.join(cache_dir, "packs"))[0]))
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp" if where == "mid-write" else ".arrow")
    index = Index(cache_dir)
    assert list(index.packs()) == [] and index.totals()[0] == 0  # the index never named it
    monkeypatch.setattr(packs_module, "ORPHAN_GRACE", 0.0)  # (a real orphan is removed after 5 minutes)
    config = load_config(env={}, overrides={"cache_dir": cache_dir})
    engine = Engine(config)  # cleans up at start
    assert list(packs_module.DiskPackStore(cache_dir).files()) == []
    assert not any(n.endswith(".tmp") for d in os.listdir(os.path.join(cache_dir, "packs"))
                   for n in os.listdir(os.path.join(cache_dir, "packs", d)))
    assert run(engine, read_all(engine, url, files)) == files


def test_a_directory_read_in_order_is_fetched_ahead_of_its_reader(tree, config):
    url, _root, files = tree
    engine = Engine(config)
    d = sorted(r for r in files if r.startswith("train/c0/"))

    async def scenario():
        ds = await engine.open_dataset(url)
        await engine.read(ds, ds.file(d[0]), 0, 1 << 20, ReadStream())  # a miss: the next files are fetched
        deadline = time.monotonic() + 10
        ahead = d[1:1 + config.engine.dir_readahead]
        assert len(ahead) >= 40  # (the default read-ahead covers the whole 50-file directory)
        while not all(engine.cached_bytes(ds, ds.file(r)) == len(files[r]) for r in ahead):
            assert time.monotonic() < deadline, "read-ahead did not fetch the following files"
            await asyncio.sleep(0.02)
        for r in ahead:
            assert engine.read_local(ds, ds.file(r), 0, 1 << 20, ReadStream()) == files[r]  # local already

    run(engine, scenario())


def test_hot_directories_are_counted_and_shown_by_status(tree, config):
    url, _root, files = tree
    engine = Engine(config)
    hot = [r for r in files if r.startswith("train/c1/")]

    async def scenario():
        ds = await engine.open_dataset(url)
        for _ in range(3):
            for r in hot:
                await engine.read(ds, ds.file(r), 0, 10, ReadStream())
        await engine.read(ds, ds.file("train/c2/0002.jpg"), 0, 10, ReadStream())
        engine.flush_stats()
        return status_report(engine.config)

    report = run(engine, scenario())
    dirs = report["hot_directories"]
    assert dirs[0]["path"] == "train/c1" and dirs[0]["url"] == url.rstrip("/")
    assert dirs[0]["score"] == pytest.approx(3 * len(hot), rel=0.01)
    assert [d["path"] for d in dirs][:2] == ["train/c1", "train/c2"]
    json.dumps(report)


def test_prefetch_cli_packs_small_files_and_reports_status(tree, cache_dir):
    url, _root, files = tree
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "prefetch", url, "--cache-dir", cache_dir, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_done"] == len(files)
    index = Index(cache_dir)
    assert len(list(index.packs())) == 1  # ~1 MB of files under the 1 MiB default threshold: one pack
    status = json.loads(subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--cache-dir", cache_dir,
                                        "--json"], capture_output=True, text=True, timeout=60).stdout)
    assert status["datasets"][0]["cached_fraction"] == 1.0


# -- the packed mirror on object storage -------------------------------------------------------------------------
def test_cachefs_pack_writes_a_verified_mirror_that_cold_reads_use_and_staleness_falls_back(s3, config):
    from cachefs.sources import open_origin
    from cachefs.testing.failing import FailingSource
    from tests.conftest import put_tree

    _server, client, bucket = s3
    rng = __import__("random").Random(3)
    files = {f"train/c{i % 4}/{i:04d}.jpg": rng.randbytes(rng.randint(1, 9000)) for i in range(300)}
    files["big.bin"] = rng.randbytes(100_000)  # over the test config's 16 KiB threshold: not packed
    put_tree(client, bucket, "ds", files)
    url = f"s3://{bucket}/ds"
    env = {"CACHEFS_CACHE_PACK_SIZE": "256KiB", "CACHEFS_CACHE_PACK_THRESHOLD": "16KiB"}
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "pack", url, "--cache-dir", config.cache.dir,
                        "--json"], capture_output=True, text=True, timeout=180, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["files"] == 300 and summary["verified"] and summary["skipped_large_files"] == 1
    assert summary["mirror"] == f"{url}.cachefs" and summary["packs"] >= 5  # ~1.3 MB in 256 KiB packs
    meta = json.loads(client.get_object(Bucket=bucket, Key="ds.cachefs/mirror.json")["Body"].read())
    assert meta["source"] == url and len(meta["packs"]) == summary["packs"]
    import pyarrow as pa

    index = pa.ipc.open_file(pa.py_buffer(client.get_object(Bucket=bucket, Key="ds.cachefs/index.arrow")["Body"]
                                          .read())).read_all()
    assert sorted(index.column("path").to_pylist()) == sorted(r for r in files if r != "big.bin")

    # A fresh node reads the tree cold: the files come in a few ranged GETs of the mirror's packs.
    client.put_object(Bucket=bucket, Key="ds/train/c1/0001.jpg", Body=b"changed after packing")
    changed = dict(files, **{"train/c1/0001.jpg": b"changed after packing"})
    cache2 = os.path.join(os.path.dirname(config.cache.dir), "cache2")
    import dataclasses

    config2 = dataclasses.replace(config, cache=dataclasses.replace(config.cache, dir=cache2))
    counting = FailingSource(open_origin(url, config2).inner)
    from cachefs.sources import RetryingSource, RetryPolicy

    source = RetryingSource(counting, RetryPolicy(3, 0.001, 0.01), 10.0)
    engine = Engine(config2)

    async def scenario():
        ds = await engine.open_dataset(url, source=source)  # its reads are counted
        got = {}
        try:
            for rel in sorted(changed):
                got[rel] = await engine.read(ds, ds.file(rel), 0, 1 << 20, ReadStream())
            await engine.persist()
        finally:
            await source.close()
        return got, engine.packs.chain.tier("mirror").files, engine.packs.chain.tier("mirror").gets

    got, mirror_files, mirror_gets = run(engine, scenario())
    assert got == changed  # every byte right, the changed file's new bytes included
    assert mirror_files == 299  # all but the changed file (its new version is not in the mirror)
    reads = [u for u, _s, _e in counting.read_ranges]
    per_file = [u for u in reads if ".cachefs/" not in u]  # the changed file, and the large one's two blocks
    assert sorted(per_file) == [f"{url}/big.bin"] * 2 + [f"{url}/train/c1/0001.jpg"]
    mirror_meta = [u for u in reads if u.endswith(("/mirror.json", "/index.arrow"))]  # through the dataset's source
    assert len(mirror_meta) == 2
    assert len(reads) - len(per_file) - 2 == mirror_gets <= summary["packs"] + 4  # a few pack GETs, not 299 file GETs

    # The mirror's packs were installed here as they are (no re-packing): byte-identical files, plus the one pack
    # this node wrote for the changed file.
    mirror_packs = {client.get_object(Bucket=bucket, Key=f"ds.cachefs/{p['name']}")["Body"].read()
                    for p in meta["packs"]}
    here = _pack_files(cache2)
    assert mirror_packs <= set(here) and len(here) == len(mirror_packs) + 1

    # One file read on a fresh node brings its whole pack and the next one, which serve later reads (after a
    # restart too) without another GET.
    cache4 = os.path.join(os.path.dirname(config.cache.dir), "cache4")
    config4 = dataclasses.replace(config, cache=dataclasses.replace(config.cache, dir=cache4))
    first_pack = sorted(r for r in files if r != "big.bin")[:2]

    async def sparse(engine):
        counting = FailingSource(open_origin(url, config4).inner)
        source = RetryingSource(counting, RetryPolicy(3, 0.001, 0.01), 10.0)
        try:
            ds = await engine.open_dataset(url, source=source)
            got = [await engine.read(ds, ds.file(rel), 0, 1 << 20, ReadStream()) for rel in first_pack]
            await engine.persist()
        finally:
            await source.close()
        return got, sum(".cachefs/packs/" in u for u, _s, _e in counting.read_ranges)  # GETs of mirror packs

    engine = Engine(config4)
    got, gets = run(engine, sparse(engine))
    # Pack 0 (one window here), pack 1 read ahead, and, as the directory's next files are read ahead and some are
    # in pack 1, pack 2 after it: whole packs, each installed as it is.
    assert got == [files[r] for r in first_pack] and 2 <= gets <= 3
    here = _pack_files(cache4)
    assert sorted(here) == sorted(client.get_object(Bucket=bucket, Key=f"ds.cachefs/{p['name']}")["Body"].read()
                                  for p in meta["packs"][:gets])
    engine = Engine(config4)  # a restarted process: the index has the installed packs
    got, gets = run(engine, sparse(engine))
    assert got == [files[r] for r in first_pack] and gets == 0

    # The prefetch CLI through the mirror counts every file it brought in, also those that came with another's window.
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "prefetch", url, "--json", "--cache-dir",
                        os.path.join(os.path.dirname(config.cache.dir), "cache3")], capture_output=True, text=True,
                       timeout=180, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)
    total = sum(len(d) for d in changed.values())
    assert done["files_done"] == len(changed) and done["bytes_fetched"] == done["bytes_done"] == total


def _pack_files(cache_dir: str) -> list[bytes]:
    out = []
    for _ds, _id, path in packs_module.DiskPackStore(cache_dir).files():
        with open(path, "rb") as f:
            out.append(f.read())
    return out


def test_a_packed_file_read_in_pieces_is_read_from_its_pack_once(tree, config):
    """The kernel asks for a page-cached file in read-ahead pieces; each piece is a slice of the member read
    and verified once for the open file, not another read and checksum of the whole member."""
    url, _root, files = tree
    rel, data = max(((r, d) for r, d in files.items() if len(d) <= config.cache.pack_threshold), key=lambda rd: len(rd[1]))
    engine = Engine(config)

    async def pieces():
        ds = await engine.open_dataset(url)
        entry = ds.file(rel)
        await engine.read(ds, entry, 0, len(data), ReadStream())  # fetched and packed
        await engine.packs.pending.flush()
        reads = []
        local = engine.packs.local
        engine.packs.local = lambda *a, **kw: reads.append(a) or local(*a, **kw)
        stream, out = ReadStream(), b""
        for start in range(0, len(data), 1000):
            got = engine.read_local(ds, entry, start, start + 1000, stream)
            assert got is not None
            out += got
        other = engine.read_local(ds, entry, 0, len(data), ReadStream())  # another open file reads it afresh
        return out, other, len(reads)

    out, other, reads = run(engine, pieces())
    assert out == data and other == data
    assert reads == 2


def test_the_mirror_is_looked_up_with_the_datasets_own_storage_options(s3, tmp_path, monkeypatch, caplog):
    """A reader of ``cachefs::`` that reaches its origin only through ``target_options`` (no AWS_ENDPOINT_URL
    pointing there) finds and uses the packed mirror: it is read through the dataset's own source and options."""
    from tests.conftest import put_tree

    server, client, bucket = s3
    files = {f"d/{i:03d}.bin": os.urandom(3000) for i in range(40)}
    put_tree(client, bucket, "opt", files)
    url = f"s3://{bucket}/opt"
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "pack", url, "--cache-dir", str(tmp_path / "p"),
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # only the options know where the origin is
    fs = fsspec.filesystem("cachefs", target_protocol="s3", target_options={"endpoint_url": server.endpoint},
                           cache_dir=str(tmp_path / "c"), dataset=url, skip_instance_cache=True)
    with caplog.at_level(logging.WARNING):
        for rel, data in files.items():
            assert fs.cat_file(f"{bucket}/opt/{rel}") == data
    assert "cannot use its packed mirror" not in caplog.text
    assert (mirror := fs.engine.packs.chain.tier("mirror")).files == len(files) and mirror.gets >= 1

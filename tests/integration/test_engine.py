"""The read path end to end against a real S3 server: bytes, single-flight, faults, staleness, eviction."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys

import pytest

from cachefs.base.errors import AccessDeniedError, StaleObjectError
from cachefs.engine import Engine, ReadStream
from cachefs.sources import RetryingSource, RetryPolicy, open_raw_origin
from cachefs.testing.failing import FailingSource
from cachefs.tiers import Keep, Served
from tests.conftest import make_files, put_tree


def sources(config):
    failing = FailingSource(open_raw_origin("s3://x", config))
    o = config.origin
    return RetryingSource(failing, RetryPolicy(o.max_attempts, o.backoff_base, o.backoff_max), o.request_timeout), failing


def run(engine: Engine, scenario, *extra_sources):
    async def main():
        try:
            return await scenario()
        finally:
            await engine.aclose()
            for src in extra_sources:
                await src.close()

    return asyncio.run(main())


@pytest.fixture
def dataset(s3):
    _, client, bucket = s3
    files = make_files(n_small=30, big_sizes=(300_000, 64 * 1024, 1))
    put_tree(client, bucket, "ds", files)
    return f"s3://{bucket}/ds", files, client, bucket


def test_reads_equal_origin_and_second_read_is_local(config, dataset):
    url, files, *_ = dataset
    engine = Engine(config)
    src, failing = sources(config)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        for path, data in files.items():
            e = ds.file(path)
            assert await engine.read(ds, e, 0, e.size) == data
            assert await engine.read(ds, e, 3, 9999) == data[3:9999]
        cold = failing.reads
        for path, data in files.items():
            e = ds.file(path)
            assert engine.read_local(ds, e, 0, e.size) == data
            assert await engine.read(ds, e, 1, e.size - 1) == data[1 : len(data) - 1]
        assert failing.reads == cold
        # metadata never goes to the origin once the manifest exists
        assert {e.path for e in ds.walk_files()} == set(files)
        assert ds.stat("small/d1").is_dir and ds.stat("big/0.bin").size == 300_000

    run(engine, scenario, src)


def test_single_flight_one_get_for_100_readers(config, dataset):
    url, files, *_ = dataset
    engine = Engine(config)
    src, failing = sources(config)
    failing.delay = 0.05

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        e = ds.file("big/1.bin")  # exactly one 64 KiB block
        got = await asyncio.gather(*(engine.read(ds, e, 0, e.size) for _ in range(100)))
        assert all(g == files["big/1.bin"] for g in got)
        assert failing.reads == 1

    run(engine, scenario, src)


@pytest.mark.parametrize("fault", ["throttle", "server_error", "truncate", "disconnect", "timeout"])
def test_transient_faults_are_retried(config, dataset, fault):
    url, files, *_ = dataset
    config = dataclasses.replace(config, origin=dataclasses.replace(config.origin, request_timeout=0.5))
    engine = Engine(config)
    src, failing = sources(config)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        failing.plan(fault, fault)
        e = ds.file("big/0.bin")
        assert await engine.read(ds, e, 0, 1000) == files["big/0.bin"][:1000]
        assert failing.reads == 3  # two failures, then success

    run(engine, scenario, src)


def test_permanent_errors_are_not_retried(config, dataset):
    url, *_ = dataset
    engine = Engine(config)
    src, failing = sources(config)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        failing.plan("forbidden")
        with pytest.raises(AccessDeniedError):
            await engine.read(ds, ds.file("big/0.bin"), 0, 10)
        assert failing.reads == 1

    run(engine, scenario, src)


def test_etag_change_mid_read_is_stale_never_mixed(config, dataset):
    url, files, client, bucket = dataset
    engine = Engine(config)
    src, _ = sources(config)
    old = files["big/0.bin"]

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        e = ds.file("big/0.bin")
        stream = ReadStream()
        first = await engine.read(ds, e, 0, 65536, stream)  # block 0 (+ read-ahead of block 1)
        assert first == old[:65536]
        await asyncio.sleep(0.2)
        await asyncio.to_thread(client.put_object, Bucket=bucket, Key="ds/big/0.bin", Body=b"new" * 100_000)
        with pytest.raises(StaleObjectError):
            await engine.read(ds, e, 0, e.size)
        # what is cached is still the old version, consistently
        assert await engine.read(ds, e, 0, 65536) == old[:65536]

    run(engine, scenario, src)


def test_pinned_manifest_keeps_old_bytes_new_manifest_sees_new(config, dataset):
    url, files, client, bucket = dataset
    engine = Engine(config)
    src, _ = sources(config)

    async def scenario():
        ds1 = await engine.open_dataset(url, source=src)
        cached = ds1.file("small/d0/f0.txt")
        assert await engine.read(ds1, cached, 0, cached.size) == files["small/d0/f0.txt"]
        await asyncio.to_thread(client.put_object, Bucket=bucket, Key="ds/small/d0/f0.txt", Body=b"v2")
        await asyncio.to_thread(client.put_object, Bucket=bucket, Key="ds/small/d0/f3.txt", Body=b"v2 too")
        rec = await engine.refresh(url, source=src)
        assert rec.current == 2
        pinned = await engine.open_dataset(url, source=src, manifest_version=1)
        e = pinned.file("small/d0/f0.txt")
        assert await engine.read(pinned, e, 0, e.size) == files["small/d0/f0.txt"]  # cached: old bytes
        with pytest.raises(StaleObjectError):  # not cached and changed: a clear error, never new bytes
            e3 = pinned.file("small/d0/f3.txt")
            await engine.read(pinned, e3, 0, e3.size)
        latest = await engine.open_dataset(url, source=src)
        e = latest.file("small/d0/f0.txt")
        assert await engine.read(latest, e, 0, e.size) == b"v2"

    run(engine, scenario, src)


def test_corrupt_block_is_refetched_counted_and_named(config, dataset, caplog):
    """A block rotten on the disk is caught, fetched again (only that block), logged naming the object, and
    counted: in the metrics' figures and, for the whole cache directory, in `cachefs status`."""
    from cachefs.status.summary import status_report

    url, files, *_ = dataset
    engine = Engine(config)
    src, failing = sources(config)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        e = ds.file("big/0.bin")
        await engine.ensure_cached(ds, e)
        path = engine.local_path(ds, e)
        engine.close()  # drop open handles (and their verified-block memory)
        with open(path, "r+b") as f:
            f.seek(70_000)
            f.write(b"garbage")
        before = failing.reads
        assert await engine.read(ds, e, 0, e.size) == files["big/0.bin"]
        assert failing.reads == before + 1  # just the bad block
        assert engine.stats.corrupt == {"block": 1}
        engine.flush_stats()
        assert status_report(config)["corrupt_reads"] == {"block": 1}
        assert any("big/0.bin: block 1 failed its checksum" in r.getMessage() for r in caplog.records)

    run(engine, scenario, src)


def test_sequential_reader_gets_read_ahead(config, dataset):
    url, *_ = dataset
    engine = Engine(config)
    src, failing = sources(config)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        e = ds.file("big/0.bin")  # 5 blocks of 64 KiB
        stream = ReadStream()
        await engine.read(ds, e, 0, 65536, stream)
        await engine.read(ds, e, 65536, 131072, stream)
        await asyncio.sleep(0.3)
        fetched_blocks = {start // 65536 for _, start, _ in failing.read_ranges}
        assert fetched_blocks >= {0, 1, 2, 3}  # window grew to 2 blocks ahead of the reader

    run(engine, scenario, src)


def test_local_reads_keep_read_ahead_going(config, dataset):
    """A sequential reader served from local blocks (from a thread, as FUSE and fsspec serve them) still has the
    blocks after them fetched ahead, not only when it reaches a missing one."""
    url, files, *_ = dataset
    engine = Engine(config)
    src, failing = sources(config)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        e = ds.file("big/0.bin")  # 5 blocks of 64 KiB; blocks 0-2 local before the reader starts
        await engine.read(ds, e, 0, 3 * 65536)
        failing.read_ranges.clear()

        def reader():
            stream = ReadStream()
            return [engine.read_local(ds, e, off, off + 32768, stream) for off in range(0, 3 * 65536, 32768)]

        got = await asyncio.to_thread(reader)
        assert b"".join(got) == files["big/0.bin"][:3 * 65536]
        rest = None
        for _ in range(200):  # read_local never fetches: the rest turns up only through read-ahead
            rest = engine.read_local(ds, e, 3 * 65536, e.size)
            if rest is not None:
                break
            await asyncio.sleep(0.02)
        assert rest == files["big/0.bin"][3 * 65536:]
        assert {start // 65536 for _, start, _ in failing.read_ranges} == {3, 4}

    run(engine, scenario, src)


def small_cache(config, s3, prefix: str, files: dict[str, bytes], capacity: str = "1MB"):
    """Upload ``files`` under ``prefix``; an engine whose cache holds only ``capacity``; (engine, source, url)."""
    _, client, bucket = s3
    put_tree(client, bucket, prefix, files)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, capacity=capacity))
    src, _ = sources(config)
    return Engine(config), src, f"s3://{bucket}/{prefix}"


def test_eviction_keeps_usage_under_capacity_and_spares_open_objects(config, s3):
    files = {f"f{i}.bin": bytes([i]) * 200_000 for i in range(12)}
    engine, src, url = small_cache(config, s3, "ev", files)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        pinned = ds.file("f0.bin")
        held = engine.open(ds, pinned)  # a reader holds f0 open throughout
        try:
            for path in files:
                e = ds.file(path)
                assert await engine.read(ds, e, 0, e.size) == files[path]
                await asyncio.sleep(0.01)
            await engine.trim()
            total, _ = engine.index.totals()
            assert total <= engine.capacity
            assert engine.cached_bytes(ds, pinned) == 200_000  # in use: never evicted
        finally:
            held.close()

    run(engine, scenario, src)


def test_memory_budget_holds_with_64_readers(config, s3):
    _, client, bucket = s3
    files = {f"m{i}.bin": bytes([i]) * 1_000_000 for i in range(8)}
    put_tree(client, bucket, "mem", files)
    engine = Engine(config)  # 8 MiB budget, 64 KiB blocks
    src, _ = sources(config)

    async def scenario():
        ds = await engine.open_dataset(f"s3://{bucket}/mem", source=src)

        async def reader(i):
            e = ds.file(f"m{i % 8}.bin")
            stream = ReadStream()
            for off in range(0, e.size, 100_000):
                assert await engine.read(ds, e, off, off + 100_000, stream) == files[e.path][off : off + 100_000]

        await asyncio.gather(*(reader(i) for i in range(64)))
        assert 0 < engine.budget.peak <= engine.budget.limit

    run(engine, scenario, src)


def test_eviction_prefers_objects_read_once(config, s3):
    """Two-touch LRU: a file read twice survives a scan of once-read files that overflows the cache."""
    files = {f"s{i}.bin": bytes([i]) * 150_000 for i in range(10)}
    engine, src, url = small_cache(config, s3, "tt", files)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        hot = ds.file("s0.bin")
        for _ in range(2):  # two accesses (two opens), each reading in several calls
            stream = ReadStream()
            for off in range(0, hot.size, 50_000):
                await engine.read(ds, hot, off, off + 50_000, stream)
        for i in range(1, 10):  # a one-off scan, oldest-first would evict s0 first
            e = ds.file(f"s{i}.bin")
            await engine.read(ds, e, 0, e.size, ReadStream())
            # Eviction in the background takes what no write holds at that moment: wait for it, so that it
            # always sees the scan's files idle (on a busy machine it otherwise ran while they were being
            # written, found them held, and went on to s0: the policy is what this test is about).
            await engine.prefetcher.drain()
            if (background := engine.eviction.trimming()) is not None:
                await background
        engine.close()  # flush access statistics, release handles
        await engine.trim()
        assert engine.cached_bytes(ds, hot) == hot.size
        assert engine.index.object(engine.object_key(ds, hot)).hits == 2
        assert engine.index.totals()[0] <= engine.capacity

    run(engine, scenario, src)


def test_a_pinned_dataset_outlives_an_overflowing_scan_of_another_and_an_explicit_purge_still_takes_it(config, s3):
    """A pin (``cachefs pin``, a CacheDataset's ``spec.pin`` through the agent) makes eviction pass a dataset over:
    another dataset read once over the cache's whole capacity evicts its own files, not the pinned ones, even those
    read once and least recently used; ``cachefs evict`` of the pinned dataset still removes it."""
    from cachefs.index.hints import HintStore

    kept = {f"k{i}.bin": bytes([i]) * 100_000 for i in range(3)}
    engine, src, url = small_cache(config, s3, "kept", kept)
    _, client, bucket = s3
    scan = {f"s{i}.bin": bytes([100 + i]) * 150_000 for i in range(10)}
    put_tree(client, bucket, "scan", scan)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        other = await engine.open_dataset(f"s3://{bucket}/scan", source=src)
        HintStore(engine.index).pin(ds.ref.id)
        for path, data in kept.items():  # read once, first: the two-touch LRU's first victims
            assert await engine.read(ds, ds.file(path), 0, len(data)) == data
        for path, data in scan.items():
            assert await engine.read(other, other.file(path), 0, len(data)) == data
            await engine.prefetcher.drain()
            if (background := engine.eviction.trimming()) is not None:
                await background
        engine.close()
        await engine.trim()
        assert all(engine.cached_bytes(ds, ds.file(p)) == len(d) for p, d in kept.items())
        assert engine.index.totals()[0] <= engine.capacity
        assert sum(engine.cached_bytes(other, other.file(p)) for p in scan) < sum(map(len, scan.values()))
        assert engine.purge_sync(ds.ref.id) >= sum(map(len, kept.values()))  # an explicit purge takes it
        assert all(engine.cached_bytes(ds, ds.file(p)) == 0 for p in kept)

    run(engine, scenario, src)


def test_a_reader_moving_through_blocks_gets_every_byte_and_a_corrupt_block_is_still_caught(config, s3):
    """Blocks of several verification pieces (2 MiB blocks, 1 MiB pieces) read by one open file in reads that
    straddle pieces and blocks: each block is read and verified once and its pieces serve the next reads; a block
    corrupted on disk is caught at that first read in a fresh process and fetched again."""
    data = os.urandom(5 * 1024 * 1024 + 12345)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, block_size=2 * 1024 * 1024))
    engine, src, url = small_cache(config, s3, "pieces", {"f.bin": data}, capacity="100MB")

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        e = ds.file("f.bin")
        await engine.ensure_cached(ds, e)
        path = engine.local_path(ds, e)
        for size in (700_000, 1 << 20, 3_000_001):
            engine.close()  # a fresh process: nothing verified yet
            f = engine.open(ds, e)
            got, pos = [], 0
            while pos < e.size:
                piece = f.read_local(pos, pos + size)
                assert piece is not None and len(piece) == min(size, e.size - pos)
                got.append(piece)
                pos += len(piece)
            f.close()
            assert b"".join(got) == data, size
        engine.close()
        with open(path, "r+b") as fh:  # bit rot in the second block, in its second piece
            fh.seek(2 * 1024 * 1024 + 1024 * 1024 + 10)
            fh.write(b"garbage")
        f = engine.open(ds, e)
        assert f.read_local(0, 1 << 20) == data[: 1 << 20]
        assert f.read_local(2 * 1024 * 1024, 2 * 1024 * 1024 + 100) is None  # caught: not served
        assert await f.read(2 * 1024 * 1024, e.size) == data[2 * 1024 * 1024:]  # fetched again
        f.close()

    run(engine, scenario, src)


class GuestTier:
    """Serves some blocks and small files as a cache group's peer would (guest data: another member owns it),
    reading them from the origin itself; the rest falls through to the origin tier as the node's own."""

    name = "peer"

    def __init__(self, src, block_size: int) -> None:
        self.src, self.block_size = src, block_size

    def takes(self, path: str, start: int) -> bool:
        return (start // self.block_size) % 2 == 1 if path.startswith("big") else int(path[5:7]) % 2 == 1

    async def fetch(self, want):
        if not self.takes(want.entry.path, want.start):
            return None
        data = await self.src.read(want.ds.ref.url + "/" + want.entry.path, want.entry.version, want.start,
                                   want.start + want.length)
        return Served(data, self.name, Keep.GUEST)

    async def close(self) -> None:
        pass


def test_guest_data_is_evicted_first_and_the_blocks_a_node_owns_stay(config, s3):
    """A node keeps what it read from its group's peers as guest data: odd blocks of the large files and every
    other small file come from a peer here. When the cache must make room, guest packs and guest blocks go
    first (guest blocks out of files that keep their own blocks), before anything of its own."""
    bs = config.cache.block_size
    files = {f"big/{i}.bin": os.urandom(6 * bs) for i in range(3)}
    files.update({f"small{i:02d}.txt": os.urandom(3000 + i) for i in range(40)})
    engine, src, url = small_cache(config, s3, "guests", files, capacity="4MB")

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        guest = GuestTier(src, bs)
        engine.blocks.chain.tiers.insert(0, guest)
        engine.packs.chain.tiers.insert(0, guest)
        for path, data in files.items():
            e = ds.file(path)
            assert await engine.read(ds, e, 0, e.size) == data
        await engine.packs.pending.flush()
        blocks, packs = engine.index.guests()
        assert sorted(blocks) == sorted(engine.object_key(ds, ds.file(f"big/{i}.bin")) for i in range(3))
        assert all(idxs == [1, 3, 5] for idxs in map(sorted, blocks.values()))
        assert packs  # the peer's small files went to packs of their own
        total, _ = engine.index.totals()
        guest_bytes = 3 * 3 * bs + sum(len(d) for p, d in files.items() if p.startswith("small") and int(p[5:7]) % 2)
        assert engine.index.guest_bytes_by_dataset() == {ds.ref.id: guest_bytes}  # (what status and labels show)
        engine.close()  # release handles, as readers closing their files would
        freed = await asyncio.to_thread(engine.eviction.make_room, engine.capacity - total + guest_bytes // 2)
        assert 0 < freed
        # Room for half the guest bytes: found among guests alone, everything the node owns stays.
        blocks_after, packs_after = engine.index.guests()
        assert sum(map(len, blocks_after.values())) + len(packs_after) < sum(map(len, blocks.values())) + len(packs)
        owned_small = [p for p in files if p.startswith("small") and int(p[5:7]) % 2 == 0]

        def owned_all_there() -> bool:
            return all({0, 2, 4} <= set(engine.index.blocks_of(engine.object_key(ds, ds.file(f"big/{i}.bin"))))
                       for i in range(3)) and all(engine.packs.has(engine.object_key(ds, ds.file(p)))
                                                  for p in owned_small)

        assert owned_all_there()
        assert engine.index.totals()[0] <= total - freed
        # Room for more than all guests: they all go, and only then some of the node's own data.
        freed2 = await asyncio.to_thread(engine.eviction.make_room, engine.capacity - total + guest_bytes + bs)
        assert freed + freed2 >= guest_bytes
        assert engine.index.guests() == ({}, [])
        assert not owned_all_there()
        engine.blocks.chain.tiers.remove(guest)
        engine.packs.chain.tiers.remove(guest)
        for path, data in files.items():  # and everything reads back right
            e = ds.file(path)
            assert await engine.read(ds, e, 0, e.size) == data

    run(engine, scenario, src)


def test_guest_data_never_makes_room_by_evicting_what_the_node_owns(config, s3):
    """A cache filled with the node's own data to near its high watermark takes no guest data: guests get only
    room under the watermark, made by evicting other guests; they are served all the same."""
    bs = config.cache.block_size
    own = {f"big/{i}.bin": os.urandom(4 * bs) for i in range(3)}  # 768 KiB of a 1 MB cache: under 95 %
    guests = {f"big/g{i}.bin": os.urandom(4 * bs) for i in range(3)}
    engine, src, url = small_cache(config, s3, "noroom", {**own, **guests}, capacity="1MB")

    class AllGuest(GuestTier):
        def takes(self, path: str, start: int) -> bool:
            return "/g" in path

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        for path, data in own.items():
            e = ds.file(path)
            assert await engine.read(ds, e, 0, e.size) == data
        tier = AllGuest(src, bs)
        engine.blocks.chain.tiers.insert(0, tier)
        held = [engine.open(ds, ds.file(path)) for path in guests]  # readers have them open: not evictable
        try:
            for path, data in guests.items():
                e = ds.file(path)
                assert await engine.read(ds, e, 0, e.size, ReadStream()) == data  # served
        finally:
            for f in held:
                f.close()
        for path in own:  # all of the node's own blocks are still here
            okey = engine.object_key(ds, ds.file(path))
            assert sorted(engine.index.blocks_of(okey)) == [0, 1, 2, 3]
        blocks, _ = engine.index.guests()
        assert sum(map(len, blocks.values())) * bs <= engine.capacity * 0.95 - 3 * 4 * bs  # only what fit under
        engine.blocks.chain.tiers.remove(tier)

    run(engine, scenario, src)


def test_eviction_hints_in_the_index_hold_for_every_process(config, s3):
    """A prefetch job's "keep what I brought" lease and staged bytes live in the index: eviction here respects a
    lease another process took, until it is released or expires, and never takes staged bytes, not even when told
    to evict everything."""
    files = {f"f{i}.bin": bytes([i]) * 200_000 for i in range(4)}
    engine, src, url = small_cache(config, s3, "hints", files, capacity="4MB")
    lease = ("from cachefs.index import Index; from cachefs.index.hints import HintStore; import sys; "
             "HintStore(Index(sys.argv[1])).keep_newer_than('job', 0.0, float(sys.argv[2]))")

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        for path, data in files.items():
            assert await engine.read(ds, ds.file(path), 0, len(data)) == data
        engine.flush_stats()
        subprocess.run([sys.executable, "-c", lease, config.cache.dir, "60"], check=True, timeout=60)
        assert engine.eviction.make_room(0) == 0  # everything was used since the lease's time
        subprocess.run([sys.executable, "-c", lease, config.cache.dir, "-1"], check=True, timeout=60)  # lapsed
        staged = engine.object_key(ds, ds.file("f0.bin"))
        engine.eviction.hints.stage(staged, 200_000)
        assert engine.purge_sync() == 3 * 200_000
        assert [okey for okey, _rec in engine.index.objects()] == [staged]
        engine.eviction.hints.unstage(staged)
        assert engine.purge_sync() == 200_000

    run(engine, scenario, src)


def test_status_reports_the_tier_bytes_of_its_own_cache_directory(config, dataset, tmp_path):
    """Two cache directories on one host (one process here; the metrics directory would be shared): each
    `cachefs status` reports what was served through its own directory, not the host's sum (both used to show the
    same figures)."""
    import dataclasses

    from cachefs.status.summary import status_report

    url, files, *_ = dataset
    other = dataclasses.replace(config, cache=dataclasses.replace(config.cache, dir=str(tmp_path / "other")))
    engine = Engine(config)

    async def scenario():
        ds = await engine.open_dataset(url)
        for e in list(ds.walk_files()):
            await engine.read(ds, e, 0, e.size)
        engine.flush_stats()

    run(engine, scenario)
    Engine(other).close()  # the second directory exists, and read nothing
    total = sum(len(b) for b in files.values())
    assert status_report(config)["tier_bytes"].get("origin", 0) == total
    assert status_report(other)["tier_bytes"].get("origin", 0) == 0


def test_the_watermark_sweep_leaves_a_scans_kept_part_under_the_high_watermark(config, s3):
    """A dataset larger than the cache is read as a scan: admitted up to the high watermark and kept there. The
    sweep that takes usage down to the low watermark leaves that part alone (it used to evict it, and a shuffled
    first epoch then read those files from the origin a second time)."""
    files = {f"e{i:02d}.bin": bytes([i]) * 90_000 for i in range(14)}
    engine, src, url = small_cache(config, s3, "scanned", files)

    async def scenario():
        ds = await engine.open_dataset(url, source=src)
        for path in files:
            e = ds.file(path)
            assert await engine.read(ds, e, 0, e.size, ReadStream()) == files[path]
        await engine.prefetcher.drain()
        if (background := engine.eviction.trimming()) is not None:
            await background
        assert engine.admission.scanning(ds.ref.id)
        kept = engine.index.totals()[0]
        assert engine.capacity * config.cache.low_watermark < kept <= engine.capacity * config.cache.high_watermark
        await engine.make_room()
        assert engine.index.totals()[0] == kept

    run(engine, scenario, src)

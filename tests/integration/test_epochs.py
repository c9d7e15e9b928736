"""A dataset twice the cache, read in a new random order each epoch through ``cachefs::`` (the engine's own
scan detection and admission: cachefs.node.scan, cachefs.node.eviction). With scan admission the part that fits
stays from one epoch to the next, so later epochs hit about the fraction cached, and no epoch costs more than the
dataset from the origin; under LRU (the control: scan admission off) they hit about c + (1 - c)·ln(1 - c)."""

from __future__ import annotations

import random
import re

import fsspec
import pytest

from tests.conftest import put_tree

C = 0.5  # the cache holds this fraction of the dataset


def _origin_bytes(server, sizes: dict[str, int]) -> int:
    total = 0
    for key, n in server.requests(reset=True)["gets"].items():
        path = key.split(" ", 1)[0]
        if path in sizes:
            m = re.search(r"bytes=(\d+)-(\d+)$", key)
            total += n * ((int(m.group(2)) - int(m.group(1)) + 1) if m else sizes[path])
    return total


@pytest.mark.parametrize("admission", [True, False], ids=["scan", "lru"])
def test_shuffled_epochs_over_a_dataset_twice_the_cache(s3, tmp_path, admission):
    server, client, bucket = s3
    rng = random.Random(11)
    files = {f"d{i % 10}/{i:04d}.bin": rng.randbytes(rng.randrange(2 << 10, 14 << 10)) for i in range(500)}
    put_tree(client, bucket, "ep", files)
    total = sum(map(len, files.values()))
    sizes = {f"/{bucket}/ep/{p}": len(b) for p, b in files.items()}
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=str(tmp_path / f"cache-{admission}"),
                           dataset=f"s3://{bucket}/ep", skip_instance_cache=True, cache_capacity=str(int(C * total)),
                           cache_min_free="0", cache_pack_size=str(64 << 10), cache_pack_threshold=str(32 << 10),
                           cache_scan_admission=admission, cache_eviction_policy="two-touch-lru" if admission else "lru",
                           # memory (which keeps read-ahead the disk did not) far under the dataset, as in production
                           cache_block_size=str(256 << 10), engine_memory_budget=str(1 << 20))
    paths = sorted(files)
    server.requests(reset=True)
    hits = []
    for epoch in range(3):
        order = list(paths)
        random.Random(epoch).shuffle(order)
        for p in order:
            with fs.open(f"{bucket}/ep/{p}", "rb") as f:
                assert f.read() == files[p]
        got = _origin_bytes(server, sizes)
        if admission:  # (LRU, the control, may take more: what it evicts is read again in the same epoch)
            assert got <= total, f"epoch {epoch + 1} took {got / total:.2f}x the dataset from the origin"
        hits.append(1 - got / total)
    if admission:
        assert min(hits[1:]) >= 0.8 * C, hits  # (bench/epoch_bench.py measures the 0.9 c target at scale)
        assert fs.engine.admission.scanning(fs.engine.known_dataset_for(f"s3://{bucket}/ep").id)
    else:
        assert max(hits[1:]) < 0.6 * C, hits  # LRU: c + (1 - c)·ln(1 - c) = 0.15 at c = 0.5 (one file at a time)


@pytest.mark.parametrize("lookahead", [1 << 20, 0], ids=["order", "off"])
def test_a_published_order_is_fetched_ahead_of_its_one_reader_once(s3, tmp_path, lookahead):
    """One reader in a shuffled order it published (cachefs.publish_order): the engine fetches the files it opens
    next ahead of it, each once. (With directory read-ahead off, so the order is the only read-ahead.)"""
    import cachefs

    server, client, bucket = s3
    rng = random.Random(5)
    files = {f"d{i % 5}/{i:04d}.bin": rng.randbytes(rng.randrange(1 << 10, 8 << 10)) for i in range(300)}
    put_tree(client, bucket, "ord", files)
    sizes = {f"/{bucket}/ord/{p}": len(b) for p, b in files.items()}
    cache = str(tmp_path / "cache")
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache, dataset=f"s3://{bucket}/ord",
                           skip_instance_cache=True, engine_dir_readahead=0, engine_order_lookahead=lookahead)
    order = sorted(files)
    random.Random(9).shuffle(order)
    cachefs.publish_order(f"s3://{bucket}/ord", order, epoch=0, cache_dir=cache)
    server.requests(reset=True)
    for p in order:
        with fs.open(f"{bucket}/ord/{p}", "rb") as f:
            assert f.read() == files[p]
    gets = server.requests(reset=True)["gets"]
    assert sum(n for key, n in gets.items() if key.split(" ", 1)[0] in sizes) == len(files)  # each file once
    started = fs.engine.prefetcher.counts.started.get("order", 0)
    if lookahead:
        assert started >= 0.9 * len(files), fs.engine.prefetcher.counts
    else:
        assert started == 0


def _large_files(s3, tmp_path, name: str, *, count: int, size: int, seed: int, capacity: float, memory: int,
                 **options):
    """``count`` block-stored files of ``size`` bytes under ``name``, and a scan-admitting cachefs filesystem over
    them whose cache holds ``capacity`` of them: ``(server, bucket, files, sizes, cache, url, fs)``."""
    server, client, bucket = s3
    rng = random.Random(seed)
    files = {f"f{i:03d}.bin": rng.randbytes(size) for i in range(count)}
    put_tree(client, bucket, name, files)
    total = sum(map(len, files.values()))
    sizes = {f"/{bucket}/{name}/{p}": len(b) for p, b in files.items()}
    cache = str(tmp_path / "cache")
    url = f"s3://{bucket}/{name}"
    fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=cache, dataset=url, skip_instance_cache=True,
                           cache_capacity=str(int(capacity * total)), cache_min_free="0", cache_scan_admission=True,
                           cache_block_size=str(128 << 10), cache_pack_threshold=str(16 << 10),
                           cache_pack_size=str(64 << 10), engine_memory_budget=str(memory), **options)
    return server, bucket, files, sizes, cache, url, fs


def test_with_an_order_files_the_reader_passed_make_room_for_what_it_reads_next(s3, tmp_path):
    """Large files (block-stored), a cache of half the dataset, scan admission, a published order each epoch: once
    the pinned part fills the cache, blocks fetched ahead of the reader take the place of files it has passed this
    epoch (eviction by next use), where pinning alone refused them and let some be fetched twice (1.009-1.015x the
    dataset in the first epoch in three runs of four with eviction by next use off). Every byte right, no epoch
    costs more than the dataset from the origin, and later epochs still hit about c."""
    import cachefs
    from cachefs.base.types import DatasetRef

    server, bucket, files, sizes, cache, url, fs = _large_files(s3, tmp_path, "big", count=24, size=600 << 10, seed=4,
                                                                capacity=C, memory=8 << 20,
                                                                engine_order_lookahead=str(1 << 20))
    total = sum(map(len, files.values()))
    engine = fs.engine
    paths = sorted(files)
    server.requests(reset=True)
    hits = []
    for epoch in range(4):
        order = list(paths)
        random.Random(100 + epoch).shuffle(order)
        cachefs.publish_order(url, order, epoch=epoch, cache_dir=cache)
        engine.ordered.orders.reread(DatasetRef.from_url(url).id)  # (else read again within a second)
        for p in order:
            with fs.open(f"{bucket}/big/{p}", "rb") as f:
                assert f.read() == files[p]
        got = _origin_bytes(server, sizes)
        assert got <= total * 1.001, f"epoch {epoch + 1} took {got / total:.3f}x the dataset from the origin"
        hits.append(1 - got / total)
    assert min(hits[1:]) >= 0.7 * C, hits
    assert engine.admission.scanning(engine.known_dataset_for(url).id)
    assert engine.eviction.passed_evicted > 0


def test_with_an_order_blocks_are_not_fetched_again_in_the_same_epoch(s3, tmp_path):
    """Large files, a quarter of the dataset fits, little memory, an order each epoch: read-ahead the disk refuses
    (nothing passed yet to make room for it) stops for a while instead of waiting in memory among the reader's own
    misses, which pushed it out before its reader came: 4-6 of 49 block GETs an epoch were repeats, at 0.19 c less
    hit ratio (bench/epoch_bench.py at its defaults, before)."""
    import cachefs
    from cachefs.base.types import DatasetRef

    server, bucket, files, sizes, cache, url, fs = _large_files(s3, tmp_path, "lg", count=16, size=512 << 10, seed=6,
                                                                capacity=0.25, memory=2 << 20)
    total = sum(map(len, files.values()))
    paths = sorted(files)
    repeats = []
    for epoch in range(4):
        order = list(paths)
        random.Random(200 + epoch).shuffle(order)
        cachefs.publish_order(url, order, epoch=epoch, cache_dir=cache)
        server.requests(reset=True)
        for p in order:
            with fs.open(f"{bucket}/lg/{p}", "rb") as f:
                assert f.read() == files[p]
        gets = server.requests()["gets"]
        repeats.append(sum(n - 1 for key, n in gets.items() if key.split(" ", 1)[0] in sizes and n > 1))
        # (at most the blocks below, again: one file's worth)
        assert _origin_bytes(server, sizes) <= total + (512 << 10), repeats
    # The blocks already on their way when the disk first refuses read-ahead (which starts the back-off) may still
    # be fetched again: one block, or under CPU load up to a file's four (seen: 2-4 in one epoch, about one run in
    # ten with three runs side by side). Without the back-off: 10-23 repeats (checked again: 10, 10, 19, 19).
    assert sum(repeats) <= 5, repeats
    assert fs.engine.admission.scanning(DatasetRef.from_url(url).id)

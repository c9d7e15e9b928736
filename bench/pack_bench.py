"""The measurements behind two small-file choices: ``cache.pack_threshold`` (which files go into packs) and
Arrow packs rather than LMDB values for the tiniest files.

Part 1, the threshold: for each file size (16 KiB … 4 MiB), the same files cached packed (the threshold just
above the size) and one local file per object (threshold 0), read warm with the page cache dropped before every
pass, one reader, in a seeded random order: files/s through fsspec (``cachefs::``) and, as root, through the
FUSE mount (a per-object file is served by passthrough there, a packed one from userspace). Printed as packed
/ per-file: above 1 the size is worth packing.

Part 2, the tiniest files: the member read the engine does for a packed file (index lookup, ``pread`` from the
open pack, xxh3) against the same bytes stored as LMDB values keyed the same way (one ``get``, xxh3), page
cache dropped and warm, with the time to write each and the disk space each takes.

The origin is the test S3 server on loopback (warm reads never reach it). Medians of ``--rounds``.

    python -m bench.pack_bench                       # 64 MiB per size
    python -m bench.pack_bench --mib 16 --rounds 1   # quicker
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from bench.fuse_bench import cachefs_mount, parallel_read
from bench.read_bench import drop_caches
from bench.small_files_bench import fsspec_parallel

KIB = 1024
SIZES_KIB = (16, 64, 256, 1024, 2048, 4096)
TINY_KIB = (1, 4, 16)


def put_files(client, bucket: str, prefix: str, size: int, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = [f"d{i % 16:02d}/f{i:06d}.bin" for i in range(count)]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda n: client.put_object(Bucket=bucket, Key=f"{prefix}/{n}", Body=rng.randbytes(size)),
                      names))
    return names


def prefetch(url: str, cache: str, threshold: int) -> None:
    env = dict(os.environ, CACHEFS_CACHE_PACK_THRESHOLD=str(threshold))
    subprocess.run([sys.executable, "-m", "cachefs.cli.main", "prefetch", url, "-q", "--cache-dir", cache],
                   check=True, env=env)


def threshold_sweep(args, server, work: str) -> None:
    client = server.client()
    client.create_bucket(Bucket="sweep")
    root = os.geteuid() == 0
    print("part 1: packed vs one file per object, warm, page cache dropped, 1 reader (files/s)")
    print(f"{'size':>8} {'files':>6}  {'fsspec packed':>13} {'per-file':>9} {'ratio':>6}"
          + (f"  {'mount packed':>12} {'per-file':>9} {'ratio':>6}" if root else ""))
    for kib in args.sizes:
        size = kib * KIB
        count = max(32, min(args.max_files, args.mib * 1024 // kib))
        prefix = f"s{kib}"
        names = put_files(client, "sweep", prefix, size, count, args.seed + kib)
        order = names[:]
        random.Random(args.seed).shuffle(order)
        url = f"s3://sweep/{prefix}"
        layouts = {"packed": size + 1, "per-file": 0}
        caches = {lay: os.path.join(work, f"c{kib}-{lay}") for lay in layouts}
        for lay, threshold in layouts.items():
            prefetch(url, caches[lay], threshold)
        via_fsspec: dict[str, list[float]] = {lay: [] for lay in layouts}
        via_mount: dict[str, list[float]] = {lay: [] for lay in layouts}
        mounts = {}
        try:
            if root:  # both layouts mounted at once, so that their rounds interleave
                for lay, threshold in layouts.items():
                    mnt = os.path.join(work, f"mnt-{lay}")
                    os.makedirs(mnt, exist_ok=True)
                    os.environ["CACHEFS_CACHE_PACK_THRESHOLD"] = str(threshold)
                    mounts[lay] = (mnt, cachefs_mount(url, mnt, caches[lay]))
            for _ in range(args.rounds):
                for lay, threshold in layouts.items():
                    os.environ["CACHEFS_CACHE_PACK_THRESHOLD"] = str(threshold)
                    drop_caches()
                    secs, got = fsspec_parallel([order], caches[lay], url)
                    assert got == count * size, (got, count * size)
                    via_fsspec[lay].append(count / secs)
                    if lay in mounts:
                        drop_caches()
                        secs, got = parallel_read([[os.path.join(mounts[lay][0], n) for n in order]])
                        assert got == count * size, (got, count * size)
                        via_mount[lay].append(count / secs)
        finally:
            for _mnt, mount in mounts.values():
                mount.close()
            os.environ.pop("CACHEFS_CACHE_PACK_THRESHOLD", None)
        fp, fu = (statistics.median(via_fsspec[k]) for k in layouts)
        line = f"{kib:>5} KiB {count:>6}  {fp:>13.0f} {fu:>9.0f} {fp / fu:>5.2f}×"
        if root:
            mp_, mu = (statistics.median(via_mount[k]) for k in layouts)
            line += f"  {mp_:>12.0f} {mu:>9.0f} {mp_ / mu:>5.2f}×"
        print(line, flush=True)
        for c in caches.values():
            shutil.rmtree(c, ignore_errors=True)


def du(path: str) -> int:
    total = 0
    for top, _dirs, files in os.walk(path):
        for f in files:
            total += os.stat(os.path.join(top, f)).st_blocks * 512
    return total


def tiny_files(args, server, work: str) -> None:
    client = server.client()
    client.create_bucket(Bucket="tiny")
    print("part 2: the tiniest files, Arrow pack members vs LMDB values (one process, random order)")
    print(f"{'size':>7} {'files':>6}  {'pack reads/s cold':>17} {'lmdb':>8} {'ratio':>6}  {'warm':>9} {'lmdb':>9} "
          f"{'ratio':>6}  {'write s pack':>12} {'lmdb':>6}  {'disk MiB pack':>13} {'lmdb':>6}")
    for kib in args.tiny:
        tiny_row(args, client, work, kib)


def tiny_row(args, client, work: str, kib: int) -> None:
    """One row of part 2: files of ``kib`` KiB packed by a prefetch, then read and written both ways."""
    import lmdb

    from cachefs.base.checksum import block_checksum
    from cachefs.base.config import load_config
    from cachefs.base.types import dataset_id
    from cachefs.engine import Engine
    from cachefs.formats.pack_file import Member
    from cachefs.index.index import Index
    from cachefs.store.pack_store import DiskPackStore

    size = kib * KIB
    count = min(args.max_files, max(1000, args.mib * 1024 // kib))
    prefix = f"t{kib}"
    put_files(client, "tiny", prefix, size, count, args.seed + kib)
    cache = os.path.join(work, f"tiny{kib}")
    prefetch(f"s3://tiny/{prefix}", cache, 1 << 20)
    eng = Engine(load_config(overrides={"cache_dir": cache}))
    idx = eng.index
    with idx.env.begin() as txn:
        okeys = [bytes(k) for k, _ in txn.cursor(db=idx._packed)]
    ds_id = dataset_id(f"s3://tiny/{prefix}")
    members = [(okey, idx.packed(okey)[2]) for okey in okeys]
    payloads = {okey: eng.packs.local(ds_id, okey, length) for okey, length in members}
    # Writing the same bytes durably both ways: packs of cache.pack_size (fsync + rename each, then the index
    # commit that names their members) against LMDB values (checksum + data, a commit per 1,024 values).
    scratch = os.path.join(work, f"scratch{kib}")
    store, scratch_index = DiskPackStore(scratch), Index(scratch)
    import pyarrow  # noqa: F401 - its import (~0.5 s) outside the clock
    t = time.perf_counter()
    batch: list[Member] = []
    batch_bytes = 0
    for okey, data in [*payloads.items(), (None, None)]:
        if okey is not None:
            batch.append(Member(okey, okey.hex(), "v", block_checksum(data), data))
            batch_bytes += len(data)
        if batch and (okey is None or batch_bytes >= eng.config.cache.pack_size):
            written = store.write("ds", batch)
            scratch_index.commit_pack("ds", written.pack_id, written.size, written.members)
            batch, batch_bytes = [], 0
    pack_write = time.perf_counter() - t
    pack_bytes = du(store.root)
    shutil.rmtree(scratch, ignore_errors=True)
    vals = os.path.join(work, f"values{kib}")
    t = time.perf_counter()
    env = lmdb.open(vals, map_size=64 << 30, subdir=True, max_dbs=1)
    items = list(payloads.items())
    for i in range(0, len(items), 1024):
        with env.begin(write=True) as txn:
            for okey, data in items[i:i + 1024]:
                txn.put(okey, block_checksum(data).to_bytes(8, "little") + data)
    lmdb_write = time.perf_counter() - t
    lmdb_bytes = du(vals)
    box = {"env": env}
    order = [okey for okey, _ in members]
    random.Random(args.seed).shuffle(order)
    lengths = dict(members)

    def read_packs() -> float:
        t = time.perf_counter()
        for okey in order:
            assert eng.packs.local(ds_id, okey, lengths[okey]) is not None
        return len(order) / (time.perf_counter() - t)

    def read_values() -> float:
        t = time.perf_counter()
        with box["env"].begin(buffers=True) as txn:
            for okey in order:
                raw = txn.get(okey)
                data = bytes(raw[8:])
                assert block_checksum(data) == int.from_bytes(raw[:8], "little")
        return len(order) / (time.perf_counter() - t)

    cold = {"pack": [], "lmdb": []}
    warm = {"pack": [], "lmdb": []}
    for _ in range(args.rounds):
        for name, fn in (("pack", read_packs), ("lmdb", read_values)):
            # as a new reader would: packs reopened, the LMDB file unmapped (mapped pages survive a drop)
            eng.packs.reads.close_all_packs()
            box["env"].close()
            drop_caches()
            box["env"] = lmdb.open(vals, subdir=True, max_dbs=1, readonly=True, lock=False)
            cold[name].append(fn())
            warm[name].append(fn())
    cp, cl = statistics.median(cold["pack"]), statistics.median(cold["lmdb"])
    wp, wl = statistics.median(warm["pack"]), statistics.median(warm["lmdb"])
    print(f"{kib:>3} KiB {count:>6}  {cp:>17.0f} {cl:>8.0f} {cl / cp:>5.2f}×  {wp:>9.0f} {wl:>9.0f} "
          f"{wl / wp:>5.2f}×  {pack_write:>12.1f} {lmdb_write:>6.1f}  {pack_bytes / 2**20:>13.1f} "
          f"{lmdb_bytes / 2**20:>6.1f}", flush=True)
    box["env"].close()
    eng.close()
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(vals, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="bytes per file size in part 1 (MiB)")
    p.add_argument("--max-files", type=int, default=8000)
    p.add_argument("--sizes", default=",".join(map(str, SIZES_KIB)), help="KiB, comma-separated (part 1)")
    p.add_argument("--tiny", default=",".join(map(str, TINY_KIB)), help="KiB, comma-separated (part 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--parts", default="1,2")
    args = p.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",") if x]
    args.tiny = [int(x) for x in args.tiny.split(",") if x]
    from cachefs.testing.s3server import S3Server

    work = tempfile.mkdtemp(prefix="cachefs-packbench-", dir=os.environ.get("CACHEFS_BENCH_DIR"))
    server = S3Server(fast=True)
    try:
        server.start()
        os.environ.update(server.env())
        print(f"# {os.cpu_count()} CPUs; S3 on loopback; page cache dropped before every cold pass "
              f"({'as root' if os.geteuid() == 0 else 'NOT root: drops and the mount are skipped'})")
        if "1" in args.parts:
            threshold_sweep(args, server, work)
        if "2" in args.parts:
            tiny_files(args, server, work)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

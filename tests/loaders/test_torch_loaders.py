"""The heavy loaders of docs/LOADERS.md against the real libraries: PyTorch's DataLoader with worker processes (by
URL and over a mount), torchvision's ImageFolder, DistributedSampler with cachefs.torch.PublishingSampler, webdataset
in DataLoader workers, and MosaicML streaming with cachefs as its only cache.

torch and mosaicml-streaming pull CUDA wheels (gigabytes), so these run in their own environment:
``make test-loaders`` (tests/loaders/setup.sh builds .venv-loaders with uv); elsewhere they skip. Every sample is
compared with what the test wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import shutil
import tarfile
import time

import fsspec
import pytest

torch = pytest.importorskip("torch", reason="the heavy loader tier: make test-loaders")
pytest.importorskip("torchvision")

from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402

from cachefs.base.types import DatasetRef  # noqa: E402
from cachefs.index.orders import list_orders, read_order  # noqa: E402
from cachefs.torch import PublishingSampler  # noqa: E402
from tests.conftest import put_tree  # noqa: E402

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse (CI runs as root)", allow_module_level=True)

from tests.integration.test_fuse import Mounted  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.filterwarnings("default")]

CLASSES = 4
PER_CLASS = 25


def image_tree(seed: int = 3) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"train/c{c}/{i:03d}.bin": rng.randbytes(rng.randrange(500, 6000))
            for c in range(CLASSES) for i in range(PER_CLASS)}


class UrlFiles(Dataset):
    """A map-style dataset that reads each file by URL through fsspec (the URL form of docs/LOADERS.md)."""

    def __init__(self, urls: list[str], options: dict) -> None:
        self.urls, self.options = urls, options

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int):
        with fsspec.open(self.urls[i], "rb", **self.options) as f:
            return i, f.read()


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def object_gets(server, bucket: str) -> list[str]:
    """The GETs of the dataset's objects the origin served since its counters were reset."""
    return [k for k in server.requests()["gets"] if f"/{bucket}/img/" in k]


def is_sample(path: str) -> bool:
    return path.endswith(".bin")


@pytest.fixture
def images(s3, tmp_path):
    server, client, bucket = s3
    files = image_tree()
    put_tree(client, bucket, "img", files)
    return server, bucket, files, str(tmp_path / "cache")


@contextlib.contextmanager
def image_folder_on_a_mount(images, tmp_path, *mount_options: str):
    """The images fixture's bucket mounted (``cachefs mount`` with ``mount_options``) and its ``train`` directory as
    a torchvision ImageFolder: yields ``(mount point, folder)``; unmounted afterwards."""
    _, bucket, _, cache = images
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache, f"s3://{bucket}/img", str(mnt), *mount_options)
    try:
        yield mnt, ImageFolder(str(mnt / "train"), loader=read_bytes, is_valid_file=is_sample)
    finally:
        m.close()


@pytest.mark.parametrize("form", ["cachefs://", "cachefs::s3://"])
def test_dataloader_workers_by_url(images, form):
    server, bucket, files, cache = images
    names = sorted(files)
    options = {"cachefs": {"cache_dir": cache, "s3": {"endpoint_url": server.endpoint}}}
    urls = [f"{form}{bucket}/img/{n}" for n in names]
    loader = DataLoader(UrlFiles(urls, options), batch_size=None, shuffle=True, num_workers=2,
                        multiprocessing_context="fork")
    gets = []
    for _epoch in range(2):
        server.requests(reset=True)
        seen = {}
        for i, data in loader:
            seen[names[int(i)]] = data
        assert seen == files
        gets.append(len(object_gets(server, bucket)))
    assert gets[0] > 0 and gets[1] == 0, gets  # epoch 2 entirely from the node's cache
    print(f"DataLoader(num_workers=2) by {form}: origin GETs per epoch {gets} for {len(files)} files")


def test_imagefolder_dataloader_over_a_mount(images, tmp_path):
    server, bucket, files, _ = images
    with image_folder_on_a_mount(images, tmp_path) as (_, folder):
        assert folder.classes == [f"c{c}" for c in range(CLASSES)]
        loader = DataLoader(folder, batch_size=None, shuffle=True, num_workers=2)
        gets = []
        for _epoch in range(2):
            server.requests(reset=True)
            got = sorted((int(label), hashlib.sha256(data).hexdigest()) for data, label in loader)
            want = sorted((int(n.split("/")[1][1:]), hashlib.sha256(b).hexdigest()) for n, b in files.items())
            assert got == want
            gets.append(len(object_gets(server, bucket)))
        assert gets[1] == 0, gets
        print(f"ImageFolder + DataLoader(num_workers=2) over the mount: origin GETs per epoch {gets}")


def test_distributed_sampler_publishes_each_epochs_order_through_the_mount(images, tmp_path):
    """Two ranks, as DistributedSampler splits a job: each rank's PublishingSampler hands that epoch's order to the
    mount, whose daemon writes it where the node's prefetcher reads it; the model sees the wrapped order."""
    _, bucket, files, cache = images
    with image_folder_on_a_mount(images, tmp_path) as (mnt, folder):
        ds_id = DatasetRef.from_url(f"s3://{bucket}/img").id
        rel = [os.path.relpath(p, mnt) for p, _ in folder.samples]
        by_path = {os.path.relpath(p, mnt): b for p, b in ((p, files[os.path.relpath(p, mnt)]) for p, _ in folder.samples)}
        for epoch in range(2):
            for rank in range(2):
                plain = DistributedSampler(folder, num_replicas=2, rank=rank, shuffle=True, seed=7)
                plain.set_epoch(epoch)
                want_order = list(plain)
                sampler = PublishingSampler(DistributedSampler(folder, num_replicas=2, rank=rank, shuffle=True, seed=7),
                                            rel, dataset=str(mnt), publisher=f"rank{rank}")
                sampler.set_epoch(epoch)
                loader = DataLoader(folder, sampler=sampler, batch_size=None, num_workers=2)
                got = [(data, label) for data, label in loader]
                assert [folder.samples[i][1] for i in want_order] == [int(label) for _, label in got]
                assert [by_path[rel[i]] for i in want_order] == [data for data, _ in got]
                published = {f.publisher: read_order(f.path) for f in list_orders(cache, ds_id)}
                assert published[f"rank{rank}"] == (epoch, [rel[i] for i in want_order])


def test_webdataset_in_dataloader_workers_by_url(s3, tmp_path):
    wds = pytest.importorskip("webdataset")
    from cachefs.loaders import register_webdataset

    server, client, bucket = s3
    samples = {}
    for n in range(4):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(10):
                key, data = f"s{n}_{i:02d}", os.urandom(2000 + i)
                samples[key] = data
                info = tarfile.TarInfo(f"{key}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        client.put_object(Bucket=bucket, Key=f"wds/shard-{n}.tar", Body=buf.getvalue())
    register_webdataset(cachefs={"cache_dir": str(tmp_path / "cache"), "s3": {"endpoint_url": server.endpoint}})
    dataset = wds.WebDataset(f"cachefs://{bucket}/wds/shard-{{0..3}}.tar", shardshuffle=False,
                             nodesplitter=None, workersplitter=wds.split_by_worker)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = {s["__key__"]: s["bin"] for s in loader}
    assert got == samples


def test_mosaicml_streaming_with_cachefs_as_its_only_cache(s3, tmp_path):
    """MDS shards on S3 read through a cachefs mount with ``local`` on the mount and ``remote=None``: streaming
    copies nothing, so after two epochs the bytes on this node are the dataset once, in cachefs's cache."""
    streaming = pytest.importorskip("streaming")
    _, client, bucket = s3
    out = tmp_path / "mds-out"
    rng = random.Random(5)
    rows = [{"x": rng.randbytes(rng.randrange(3000, 9000)), "y": i} for i in range(300)]
    with streaming.MDSWriter(out=str(out), columns={"x": "bytes", "y": "int"}, size_limit=1 << 18) as writer:
        for row in rows:
            writer.write(row)
    put_tree(client, bucket, "mds", {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()})
    dataset_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(out)
    cache, mnt = tmp_path / "cache", tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(str(cache), f"s3://{bucket}/mds", str(mnt))
    try:
        ds = streaming.StreamingDataset(local=str(mnt), remote=None, shuffle=True, batch_size=1)
        for _epoch in range(2):
            got = sorted((int(s["y"]), s["x"]) for s in ds)
            assert got == [(r["y"], r["x"]) for r in rows]
        m.close()
        on_disk = sum(p.stat().st_size for sub in ("data", "packs") for p in (cache / sub).rglob("*") if p.is_file())
        others = [p for p in tmp_path.rglob("*") if p.is_file() and cache not in p.parents]
        assert dataset_bytes <= on_disk <= dataset_bytes * 1.05 + (1 << 20), (dataset_bytes, on_disk)
        assert not others, f"files outside the cache: {others[:5]}"
        print(f"MosaicML: dataset {dataset_bytes} B, cachefs cache after two epochs {on_disk} B "
              f"({on_disk / dataset_bytes:.3f}x), no other copy")
    finally:
        m.close()


def test_ray_data_reads_parquet_through_cachefs_in_its_workers(s3, tmp_path):
    """Ray Data pickles the filesystem into its worker processes: the cachefs options (cache directory, the
    origin's endpoint) travel with it, and every row comes back."""
    ray = pytest.importorskip("ray")
    import pyarrow as pa
    import pyarrow.parquet as pq

    server, client, bucket = s3
    table = pa.table({"idx": list(range(900)), "v": [i * 3 for i in range(900)]})
    for n in range(3):
        buf = io.BytesIO()
        pq.write_table(table.slice(n * 300, 300), buf)
        client.put_object(Bucket=bucket, Key=f"tab/part-{n}.parquet", Body=buf.getvalue())
    fs, path = fsspec.core.url_to_fs(f"cachefs://{bucket}/tab", cachefs={
        "cache_dir": str(tmp_path / "cache"), "s3": {"endpoint_url": server.endpoint}})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = sorted((r["idx"], r["v"]) for r in ray.data.read_parquet(path, filesystem=fs).iter_rows())
    finally:
        ray.shutdown()
    assert rows == [(i, i * 3) for i in range(900)]


def test_dali_file_reader_over_a_mount_sticks_to_its_shard_and_maps_files(s3, tmp_path):
    """DALI's file reader on a cachefs mount, as docs/LOADERS.md sets it: each shard keeps its own files
    (``stick_to_shard=True``, so a node's cache holds its shard, not the dataset) and reads them by mmap (the
    pages come from the cache files); CPU pipeline, no GPU needed. Two shards, two epochs, every sample checked."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    server, client, bucket = s3
    rng = random.Random(8)
    files = {f"c{c}/{i:02d}.jpg": rng.randbytes(rng.randrange(800, 5000)) for c in range(2) for i in range(10)}
    put_tree(client, bucket, "dali", files)
    cache, mnt = str(tmp_path / "cache"), tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache, f"s3://{bucket}/dali", str(mnt))
    try:
        got: dict[int, list[tuple[int, bytes]]] = {0: [], 1: []}
        gets = []
        for _epoch in range(2):
            server.requests(reset=True)
            for shard in range(2):
                @pipeline_def(batch_size=1, num_threads=1, device_id=None)
                def pipe(shard=shard):
                    data, label = fn.readers.file(file_root=str(mnt), shard_id=shard, num_shards=2,
                                                  stick_to_shard=True, dont_use_mmap=False, random_shuffle=True,
                                                  name="files")
                    return data, label

                p = pipe()
                p.build()
                samples = []
                for _ in range(p.epoch_size("files") // 2):
                    data, label = p.run()
                    samples.append((int(label.as_array().ravel()[0]), bytes(data.as_array()[0])))
                got[shard].extend(samples)
                del p
            gets.append(len([k for k in server.requests()["gets"] if f"/{bucket}/dali/" in k]))
        want = sorted((int(n[1]), b) for n, b in files.items())
        assert sorted(got[0] + got[1]) == sorted(want * 2)  # every file once per epoch, right label and bytes
        assert not {b for _, b in got[0]} & {b for _, b in got[1]}  # each shard kept to its own files
        assert gets[1] == 0, gets
        print(f"DALI readers.file over the mount (2 shards, mmap): origin GETs per epoch {gets}")
    finally:
        m.close()


def test_declared_sampler_orders_are_torchs_distributed_sampler_orders():
    """cachefs computes DistributedSampler's orders without torch (cachefs.prefetch.samplers): the same indices
    for every rank, over sizes, world sizes, seeds, epochs, drop_last and shuffle."""
    import itertools

    from cachefs.prefetch.samplers import SamplerSpec, distributed_indices

    for n, world, seed, epoch, drop, shuffle in itertools.product((1, 7, 100, 1001), (1, 3, 8), (0, 17, 2**40 + 3),
                                                                  (0, 5), (False, True), (True, False)):
        if drop and n < world:
            continue
        spec = SamplerSpec(seed=seed, world_size=world, ranks=tuple(range(world)), shuffle=shuffle, drop_last=drop)
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                         drop_last=drop)
            sampler.set_epoch(epoch)
            assert distributed_indices(n, epoch, spec, rank) == list(sampler), (n, world, seed, epoch, drop, rank)


def test_a_mount_with_a_declared_sampler_publishes_each_epochs_order_ahead_of_the_job(images, tmp_path):
    """``cachefs mount --sampler torch-distributed:...``: the job runs a plain DistributedSampler (no cachefs code);
    the mount publishes its rank's order for epoch 0 at once and epoch 1's when the reader reaches the end of
    epoch 0, each the order the job then reads."""
    _, bucket, files, cache = images
    ds_id = DatasetRef.from_url(f"s3://{bucket}/img").id
    # (--keep-opens: this dataset is soon all packed small files here, and the kernel would then stop asking the
    # daemon to open files: right, as nothing is left to fetch, but the daemon would no longer see the epoch end)
    with image_folder_on_a_mount(images, tmp_path, "--keep-opens", "--sampler",
                                 "torch-distributed:seed=11,world-size=2,ranks=1,under=train,match=*.bin") as (mnt, folder):
        rel = [os.path.relpath(p, mnt) for p, _ in folder.samples]
        sampler = DistributedSampler(folder, num_replicas=2, rank=1, shuffle=True, seed=11)
        loader = DataLoader(folder, sampler=sampler, batch_size=None, num_workers=2)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want = [rel[i] for i in sampler]
            (order,) = [read_order(f.path) for f in list_orders(cache, ds_id) if f.publisher == "sampler-r1"]
            assert order == (epoch, want), f"epoch {epoch}: the mount's order is not the sampler's"
            assert [data for data, _ in loader] == [files[p] for p in want]
            deadline = time.monotonic() + 30
            while read_order(next(f.path for f in list_orders(cache, ds_id)))[0] == epoch:  # the daemon, each second
                assert time.monotonic() < deadline, "the next epoch's order was not published"
                time.sleep(0.2)

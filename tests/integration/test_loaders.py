"""The loaders of docs/LOADERS.md, by URL, against the real libraries (HF datasets, webdataset, pyarrow, polars).

Every sample is compared with what the test wrote. The origin's endpoint is given only in the storage options
(``AWS_ENDPOINT_URL`` is unset), so a form that dropped the origin's options would fail to reach it; the cache
directory is given only there too, so a form that dropped ours would read through another cache, which the
tests see (they count what landed in theirs). Torch, torchvision and MosaicML streaming are in tests/loaders/.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile

import fsspec
import pytest

datasets = pytest.importorskip("datasets")
wds = pytest.importorskip("webdataset")
pl = pytest.importorskip("polars")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = 600
PARTS = 3
SHARDS = 3
PER_SHARD = 8


@pytest.fixture
def origin(s3, monkeypatch, tmp_path):
    """A bucket with Parquet parts and WebDataset shards; returns (server, bucket, table, samples, options)."""
    server, client, bucket = s3
    table = pa.table({"idx": list(range(ROWS)), "text": [f"row {i} " * (i % 7 + 1) for i in range(ROWS)]})
    per = ROWS // PARTS
    for n in range(PARTS):
        buf = io.BytesIO()
        pq.write_table(table.slice(n * per, per), buf)
        client.put_object(Bucket=bucket, Key=f"tab/part-{n}.parquet", Body=buf.getvalue())
    samples = {}
    for n in range(SHARDS):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(PER_SHARD):
                key = f"s{n:02d}_{i:03d}"
                cls, img = str((n * PER_SHARD + i) % 10).encode(), os.urandom(1000 + 37 * i)
                samples[key] = (cls, img)
                for ext, data in (("cls", cls), ("jpg", img)):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        client.put_object(Bucket=bucket, Key=f"wds/shard-{n:04d}.tar", Body=buf.getvalue())
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    cache = str(tmp_path / "cache")
    options = {"cachefs": {"cache_dir": cache, "s3": {"endpoint_url": server.endpoint}}}
    return server, bucket, table, samples, options


def datasets_in(options) -> int:
    """How many datasets were opened in the options' cache directory (each holds a manifest lock there)."""
    locks = os.path.join(options["cachefs"]["cache_dir"], "locks")
    return sum(name.endswith(".manifest") for name in os.listdir(locks)) if os.path.isdir(locks) else 0


def test_one_options_dict_means_the_same_in_every_url_form(origin):
    """Nested (``cachefs={..., "s3": {...}}``) and side by side (``cachefs={...}, s3={...}``), chained and single-hop:
    the same cache and the same origin."""
    server, bucket, _, _, nested = origin
    side = {"cachefs": {"cache_dir": nested["cachefs"]["cache_dir"]}, "s3": {"endpoint_url": server.endpoint}}
    want = pq.read_table(io.BytesIO(server.client().get_object(Bucket=bucket, Key="tab/part-1.parquet")["Body"].read()))
    for url in (f"cachefs::s3://{bucket}/tab/part-1.parquet", f"cachefs://{bucket}/tab/part-1.parquet"):
        for opts in (nested, side):
            if url.startswith("cachefs://") and opts is side:
                opts = {"cachefs": {**side["cachefs"], **side}}  # a single hop takes only its own dict
                opts["cachefs"].pop("cachefs")
            fs, path = fsspec.core.url_to_fs(url, **opts)
            assert fs.target_protocol == "s3"
            with fs.open(path) as f:
                assert pq.read_table(f).equals(want), (url, opts)
    assert datasets_in(nested) == 1


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_datasets_parquet_by_url(origin, streaming, tmp_path):
    server, bucket, table, _, options = origin
    ds = datasets.load_dataset("parquet", data_files=f"cachefs://{bucket}/tab/*.parquet", split="train",
                               streaming=streaming, storage_options=options, cache_dir=str(tmp_path / "hf"))
    rows = sorted(((r["idx"], r["text"]) for r in ds), key=lambda r: r[0])
    assert rows == list(zip(table["idx"].to_pylist(), table["text"].to_pylist(), strict=True))
    assert datasets_in(options) == 1, "the options' cache_dir was not the cache read through"
    if streaming:  # a second epoch: every byte from the cache, no GET
        server.requests(reset=True)
        assert sum(1 for _ in ds) == ROWS
        assert not [k for k in server.requests()["gets"] if f"/{bucket}/tab/" in k]


def test_hf_datasets_chained_url(origin, monkeypatch, tmp_path):
    """HF datasets hands a first hop without '://' no options (it takes 'cachefs' for a local file): with a chained
    URL the origin's options go beside ours and ours come from the environment, as docs/LOADERS.md says."""
    server, bucket, table, _, options = origin
    monkeypatch.setenv("CACHEFS_CACHE_DIR", options["cachefs"]["cache_dir"])
    side = {"s3": {"endpoint_url": server.endpoint}}
    ds = datasets.load_dataset("parquet", data_files=f"cachefs::s3://{bucket}/tab/*.parquet", split="train",
                               storage_options=side, cache_dir=str(tmp_path / "hf"))
    assert sorted(ds["idx"]) == table["idx"].to_pylist()
    assert datasets_in(options) == 1
    with pytest.raises(OSError):  # its streaming mode opens the first hop as a local path
        next(iter(datasets.load_dataset("parquet", data_files=f"cachefs::s3://{bucket}/tab/*.parquet", split="train",
                                        streaming=True, storage_options=side)))


def test_webdataset_by_url(origin):
    from cachefs.loaders import register_webdataset

    server, bucket, _, samples, options = origin
    register_webdataset(**options)
    url = f"cachefs://{bucket}/wds/shard-{{0000..{SHARDS - 1:04d}}}.tar"
    for epoch in range(2):
        server.requests(reset=True)
        got = {s["__key__"]: (s["cls"], s["jpg"]) for s in wds.WebDataset(url, shardshuffle=False)}
        assert got == samples
        shard_gets = [k for k in server.requests()["gets"] if f"/{bucket}/wds/" in k]
        assert (len(shard_gets) > 0) == (epoch == 0), shard_gets
    with pytest.raises(OSError, match="read-only"):
        wds.gopen(f"cachefs://{bucket}/wds/new.tar", "wb")


def test_webdataset_chained_url_is_split_by_webdataset(origin):
    """webdataset reads '::' as a union of shard lists: the chained form cannot reach any handler (documented)."""
    _, bucket, _, _, options = origin
    from cachefs.loaders import register_webdataset

    register_webdataset(**options)
    with tempfile.TemporaryDirectory() as d, pytest.raises(OSError):
        os.chdir(d)
        try:
            list(wds.WebDataset(f"cachefs::s3://{bucket}/wds/shard-0000.tar", shardshuffle=False))
        finally:
            os.chdir("/")


def test_pyarrow_and_polars_by_url(origin):
    from cachefs.loaders import arrow_dataset

    _, bucket, table, _, options = origin
    for url in (f"cachefs://{bucket}/tab", f"cachefs::s3://{bucket}/tab/", f"cachefs://{bucket}/tab/*.parquet"):
        got = arrow_dataset(url, **options).to_table().sort_by("idx")
        assert got.equals(table), url
    lazy = pl.scan_pyarrow_dataset(arrow_dataset(f"cachefs://{bucket}/tab", **options))
    picked = lazy.filter(pl.col("idx") % 50 == 0).select("idx", "text").collect().sort("idx")
    want = table.to_pandas()
    want = want[want["idx"] % 50 == 0]
    assert picked["idx"].to_list() == want["idx"].tolist()
    assert picked["text"].to_list() == want["text"].tolist()
    with pytest.raises(FileNotFoundError):
        arrow_dataset(f"cachefs://{bucket}/tab/*.nothing", **options)
    with pytest.raises(OSError, match="not a cachefs URL"):
        arrow_dataset(f"s3://{bucket}/tab", **options)

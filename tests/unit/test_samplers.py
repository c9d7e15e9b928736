"""Orders from a declared sampler (cachefs.prefetch.samplers): the spec, the files it covers, each rank's share,
and the publisher that keeps the orders one epoch ahead. tests/loaders compares the orders with torch's own
DistributedSampler."""

from __future__ import annotations

import pytest

from cachefs.base.errors import ConfigError
from cachefs.base.types import DatasetRef
from cachefs.index.orders import list_orders, read_order
from cachefs.prefetch.orders import OrderBook
from cachefs.prefetch.samplers import (
    SamplerPublisher,
    SamplerSpec,
    distributed_indices,
    parse_sampler,
    sampler_files,
    sampler_orders,
    torch_randperm,
)

URL = "s3://bucket/ds"
DS = DatasetRef.from_url(URL).id


def test_a_spec_reads_every_option_and_defaults_the_rest():
    spec = parse_sampler("torch-distributed:seed=7,world-size=8,ranks=0-3+6,under=/train/,match=*.JPEG,"
                         "drop-last=true,shuffle=false,start-epoch=12")
    assert spec == SamplerSpec(seed=7, world_size=8, ranks=(0, 1, 2, 3, 6), shuffle=False, drop_last=True,
                               under="train", match="*.JPEG", start_epoch=12)
    assert parse_sampler("torch-distributed") == SamplerSpec()
    assert parse_sampler("torch-distributed:rank=2,world-size=4").ranks == (2,)


@pytest.mark.parametrize("text, words", [
    ("numpy-shuffle", "known samplers"), ("torch-distributed:seed", "key=value"),
    ("torch-distributed:seeds=1", "unknown option"), ("torch-distributed:world-size=0", "at least 1"),
    ("torch-distributed:world-size=2,ranks=2", "below world-size"),
    ("torch-distributed:seed=x", "seed must be a whole number, not 'x'"),
    ("torch-distributed:shuffle=maybe", "true or false"),
])
def test_bad_specs_are_clear_errors(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_sampler(text)


def test_the_permutation_is_one_and_repeatable():
    perm = torch_randperm(1000, 42)
    assert sorted(perm) == list(range(1000)) and perm != list(range(1000))
    assert perm == torch_randperm(1000, 42) and perm != torch_randperm(1000, 43)
    assert torch_randperm(0, 1) == [] and torch_randperm(1, 1) == [0]


def test_ranks_share_an_epoch_as_the_distributed_sampler_does():
    spec = SamplerSpec(seed=3, world_size=3, ranks=(0, 1, 2))
    shares = [distributed_indices(10, 4, spec, r) for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 4]  # padded to a multiple of the world size
    assert set().union(*map(set, shares)) == set(range(10))
    cut = SamplerSpec(world_size=3, ranks=(0, 1, 2), drop_last=True)
    assert sum(len(distributed_indices(10, 0, cut, r)) for r in range(3)) == 9
    assert distributed_indices(10, 0, SamplerSpec(world_size=2, shuffle=False), 1) == [1, 3, 5, 7, 9]


def test_the_samples_are_the_matching_files_under_the_directory_in_path_order():
    paths = ["train/b/2.JPEG", "train/a/1.JPEG", "train/a/x.txt", "val/a/3.JPEG", "train/a/0.JPEG"]
    spec = SamplerSpec(under="train", match="*.JPEG")
    assert sampler_files(paths, spec) == ["train/a/0.JPEG", "train/a/1.JPEG", "train/b/2.JPEG"]
    orders = sampler_orders(sampler_files(paths, spec), SamplerSpec(world_size=1, under="train"), 0)
    assert sorted(orders[0]) == ["train/a/0.JPEG", "train/a/1.JPEG", "train/b/2.JPEG"]


def test_the_publisher_keeps_each_rank_one_epoch_ahead_and_resumes_where_it_was(tmp_path):
    files = [f"f{i:03d}" for i in range(64)]
    spec = SamplerSpec(seed=1, world_size=2, ranks=(0, 1), start_epoch=3)
    book = OrderBook(str(tmp_path))
    pub = SamplerPublisher(spec, str(tmp_path), DS, URL, files, book)
    pub.start()

    def published() -> dict[str, tuple]:
        return {f.publisher: read_order(f.path) for f in list_orders(str(tmp_path), DS)}

    assert published() == {f"sampler-r{r}": (3, sampler_orders(files, spec, 3)[r]) for r in (0, 1)}
    pub.tick()
    assert {p: got[0] for p, got in published().items()} == {"sampler-r0": 3, "sampler-r1": 3}  # nobody read yet
    for path in sampler_orders(files, spec, 3)[0]:  # rank 0's reader goes through its epoch
        book.opened(DS, path, 0, lambda p: 1)
    pub.tick()
    got = published()
    assert got["sampler-r0"] == (4, sampler_orders(files, spec, 4)[0]) and got["sampler-r1"][0] == 3
    again = SamplerPublisher(spec, str(tmp_path), DS, URL, files, OrderBook(str(tmp_path)))  # a daemon restarted
    again.start()
    assert {p: g[0] for p, g in published().items()} == {"sampler-r0": 4, "sampler-r1": 3}
    with pytest.raises(ConfigError, match="no file"):
        SamplerPublisher(spec, str(tmp_path), DS, URL, [], book)

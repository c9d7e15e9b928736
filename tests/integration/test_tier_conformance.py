"""Every tier passes the tier conformance suite, built as the engine builds it, against real backends: the origin (a
moto S3 server), a packed mirror written by ``cachefs pack``, and a cache group's member (``cachefs agent``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cachefs.base.aio import run_sync
from cachefs.base.config import load_config
from cachefs.base.types import object_key
from cachefs.engine import Engine
from cachefs.testing.tier_conformance import TierCase, TierConformance
from cachefs.tiers import Keep, Want
from tests.conftest import put_tree
from tests.integration.test_cluster import BLOCK, ENV, Group

FILES = {"big/a.bin": os.urandom(3 * BLOCK + 1000), "small/b.txt": os.urandom(5000), "small/c.txt": b"tiny"}


def _config(cache_dir: str):
    return load_config(env={}, overrides={"cache_dir": cache_dir, "cache_block_size": BLOCK,
                                          "cache_pack_threshold": 16 * 1024, "cache_pack_size": 256 * 1024,
                                          "cache_min_free": "0", "origin_backoff_base": 0.001,
                                          "origin_backoff_max": 0.01})


def _wants(ds, path: str, *, blocks: bool) -> list[tuple[Want, bytes]]:
    e = ds.file(path)
    okey, data = object_key(ds.ref.id, e.path, e.version), FILES[path]
    if not blocks:
        return [(Want(ds, e, okey, 0, e.size), data)]
    return [(Want(ds, e, okey, s, min(BLOCK, e.size - s)), data[s:s + BLOCK]) for s in range(0, e.size, BLOCK)]


@pytest.fixture
def origin_url(s3):
    _, client, bucket = s3
    put_tree(client, bucket, "ds", FILES)
    return f"s3://{bucket}/ds"


@pytest.fixture
def engine_for(tmp_path):
    engines = []

    def make(cache_dir: str, url: str):
        engine = Engine(_config(cache_dir))
        engines.append(engine)
        return engine, run_sync(engine.open_dataset(url))

    yield make
    for engine in engines:
        run_sync(engine.aclose())


class TestOriginTier(TierConformance):
    @pytest.fixture
    def tier_case(self, origin_url, engine_for, tmp_path):
        engine, ds = engine_for(str(tmp_path / "cache"), origin_url)
        has = _wants(ds, "big/a.bin", blocks=True) + _wants(ds, "small/b.txt", blocks=False)
        return TierCase(engine.blocks.chain.tier("origin"), run_sync, has, [], engine.config.cache.dir)


class TestMirrorTier(TierConformance):
    @pytest.fixture
    def tier_case(self, origin_url, engine_for, tmp_path):
        r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "pack", origin_url, "--cache-dir",
                            str(tmp_path / "packer")], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **ENV})
        assert r.returncode == 0, r.stderr
        engine, ds = engine_for(str(tmp_path / "cache"), origin_url)
        big = ds.file("big/a.bin")
        small = ds.file("small/b.txt")
        lacks = [Want(ds, big, object_key(ds.ref.id, big.path, big.version), 0, big.size),  # not in the mirror
                 Want(ds, small, object_key(ds.ref.id, small.path, small.version), 10, 100)]  # not a whole file
        has = _wants(ds, "small/b.txt", blocks=False) + _wants(ds, "small/c.txt", blocks=False)
        return TierCase(engine.packs.chain.tier("mirror"), run_sync, has, lacks, engine.config.cache.dir,
                        batches=True)


class TestPeerTier(TierConformance):
    """A reader on a node of a group of one member (its agent on a loopback port): its own cache directory, the
    agent's members file copied into it, as the agent of its node would have written it."""

    @pytest.fixture(params=["block", "small"])
    def tier_case(self, request, s3, origin_url, engine_for, tmp_path):
        server, _, _ = s3
        group = Group(tmp_path, server.env(), ["a"], origin_url)
        group.start("a")
        request.addfinalizer(group.stop)
        reader_dir = tmp_path / "reader"
        os.makedirs(reader_dir / "cluster")
        for name in ("members.json", "placement.npz"):
            src = os.path.join(group.cache("a"), "cluster", name)
            if os.path.exists(src):
                shutil.copy(src, reader_dir / "cluster" / name)
        engine, ds = engine_for(str(reader_dir), origin_url)
        big = ds.file("big/a.bin")
        okey = object_key(ds.ref.id, big.path, big.version)
        if request.param == "block":
            has = _wants(ds, "big/a.bin", blocks=True)
            lacks = [Want(ds, big, okey, 100, 1000)]  # not a whole block: not the group's to place
            tier = engine.blocks.chain.tier("peer")
        else:
            has = _wants(ds, "small/b.txt", blocks=False) + _wants(ds, "small/c.txt", blocks=False)
            small = ds.file("small/b.txt")
            lacks = [Want(ds, small, object_key(ds.ref.id, small.path, small.version), 10, 100)]
            tier = engine.packs.chain.tier("peer")
        return TierCase(tier, run_sync, has, lacks, str(reader_dir), Keep.GUEST)

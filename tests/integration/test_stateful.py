"""The core invariant, checked by Hypothesis over any interleaving of reads, origin changes + refreshes,
evictions and engine restarts: a read returns the bytes the origin had when the manifest was taken, or a
clear StaleObjectError (only if the object has changed since) — never other bytes."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachefs.base.config import load_config
from cachefs.base.errors import StaleObjectError
from cachefs.engine import Engine

NAMES = ["a.bin", "d/b.bin", "d/e/c.bin"]
BLOCK = 64 * 1024


class CacheMachine(RuleBasedStateMachine):
    @initialize(sizes=st.lists(st.integers(0, 3 * BLOCK + 100), min_size=3, max_size=3), seed=st.integers(0, 10**6))
    def setup(self, sizes, seed):
        self.tmp = tempfile.mkdtemp(prefix="cachefs-hyp-")
        self.root = os.path.join(self.tmp, "origin")
        self.rng_seed = seed
        self.origin: dict[str, bytes] = {}
        for name, size in zip(NAMES, sizes, strict=True):
            self._write(name, os.urandom(size))
        self.config = load_config(env={}, overrides={
            "cache_dir": os.path.join(self.tmp, "cache"), "cache_block_size": BLOCK, "cache_min_free": "0",
            "engine_memory_budget": 4 * BLOCK, "cache_pack_threshold": BLOCK, "cache_pack_size": 2 * BLOCK,
        })  # files up to one block are packed, larger ones take the block path
        self.loop = asyncio.new_event_loop()
        self.engine = Engine(self.config)
        self.snapshot = dict(self.origin)
        self.ds = self.loop.run_until_complete(self.engine.open_dataset(f"file://{self.root}"))

    def _write(self, name: str, data: bytes) -> None:
        path = os.path.join(self.root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".new~"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # a new inode: a new version even within one mtime tick
        self.origin[name] = data

    @rule(name=st.sampled_from(NAMES), start=st.integers(0, 4 * BLOCK), length=st.integers(0, 2 * BLOCK))
    def read(self, name, start, length):
        entry = self.ds.file(name)
        want = self.snapshot[name][start : start + length]
        try:
            got = self.loop.run_until_complete(self.engine.read(self.ds, entry, start, start + length))
        except StaleObjectError:
            assert self.origin[name] != self.snapshot[name], "stale error for an unchanged object"
            return
        assert got == want

    @rule(name=st.sampled_from(NAMES), size=st.integers(0, 3 * BLOCK))
    def change_origin(self, name, size):
        self._write(name, os.urandom(size))

    @rule()
    def refresh(self):
        self.loop.run_until_complete(self.engine.refresh(f"file://{self.root}"))
        self.ds = self.loop.run_until_complete(self.engine.open_dataset(f"file://{self.root}"))
        self.snapshot = dict(self.origin)

    @rule()
    def write_packs(self):
        self.loop.run_until_complete(self.engine.persist())

    @rule()
    def evict_all(self):
        self.engine.purge_sync()

    @rule()
    def restart(self):
        self.loop.run_until_complete(self.engine.aclose())
        self.loop.close()
        self.loop = asyncio.new_event_loop()
        self.engine = Engine(self.config)
        self.ds = self.loop.run_until_complete(
            self.engine.open_dataset(f"file://{self.root}", manifest_version=self.ds.version))

    @precondition(lambda self: hasattr(self, "engine"))
    @invariant()
    def usage_matches_blocks_and_packs(self):
        total, _ = self.engine.index.totals()
        assert total == sum(rec.cached_bytes for _, rec in self.engine.index.objects()) + sum(
            p.size for p in self.engine.index.packs())

    def teardown(self):
        if hasattr(self, "engine"):
            self.loop.run_until_complete(self.engine.aclose())
            self.loop.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


CacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheInvariant = CacheMachine.TestCase

"""The conformance suite every tier (:class:`~cachefs.tiers.Tier`) passes.

A test class subclasses :class:`TierConformance` and provides a ``tier_case`` fixture: a :class:`TierCase` with the
tier, built as the engine builds it, and wants it has and lacks. The suite checks the seam's promises: a tier
answers exactly what it was asked (the bytes, its name, what the caller should keep) or None, never fills the
cache, answers many concurrent asks alike, and is registered under its name; a batch it brings holds the bytes
asked for, verifies, and can be fetched again by its reference; nothing of its own stays in flight after a drain;
a dataset it serves has no problem.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CacheFSError
from cachefs.formats.mirror_index import MirrorWindow
from cachefs.tiers import TIERS, BatchRef, Keep, Served, Tier, Want

__all__ = ["TierCase", "TierConformance"]


@dataclass
class TierCase:
    """What a tier is tested with. ``run(coro)`` runs a coroutine where the tier lives (its event loop);
    ``has``: wants the tier holds, with the bytes each must answer; ``lacks``: wants it must answer None (empty
    for a tier that always answers, the origin); ``cache_dir``: the reading node's cache directory, which the tier
    must leave alone; ``keeps``: what the tier says to keep of what it serves; ``batches``: whether it serves
    the ``has`` wants in batches (a packed mirror)."""

    tier: Tier
    run: Callable[[Awaitable], object]
    has: list[tuple[Want, bytes]]
    lacks: list[Want] = field(default_factory=list)
    cache_dir: str = ""
    keeps: Keep = Keep.OWN
    batches: bool = False


def _tree(path: str) -> dict[str, tuple[int, int]]:
    out = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


class TierConformance:
    """Subclasses provide a ``tier_case`` fixture (a :class:`TierCase`)."""

    def test_serves_exactly_what_was_asked(self, tier_case: TierCase):
        assert tier_case.has, "a case must name something the tier holds"
        for want, expected in tier_case.has:
            served = tier_case.run(tier_case.tier.fetch(want))
            assert isinstance(served, Served), want
            assert bytes(served.data) == expected and len(served.data) == want.length
            assert served.tier == tier_case.tier.name
            assert served.keep is tier_case.keeps

    def test_answers_none_for_what_it_lacks(self, tier_case: TierCase):
        for want in tier_case.lacks:
            assert tier_case.run(tier_case.tier.fetch(want)) is None, want

    def test_never_fills_the_cache(self, tier_case: TierCase):
        before = _tree(tier_case.cache_dir) if tier_case.cache_dir else {}
        for want, _expected in tier_case.has:
            tier_case.run(tier_case.tier.fetch(want))
        if tier_case.cache_dir:
            assert _tree(tier_case.cache_dir) == before

    def test_concurrent_asks_get_the_same_bytes(self, tier_case: TierCase):
        want, expected = tier_case.has[0]

        async def many() -> list[Served | None]:
            return list(await asyncio.gather(*(tier_case.tier.fetch(want) for _ in range(16))))

        got = tier_case.run(many())
        assert isinstance(got, list) and all(s is not None and bytes(s.data) == expected for s in got)

    def test_is_registered_under_its_name(self, tier_case: TierCase):
        assert TIERS[tier_case.tier.name] is type(tier_case.tier)

    def test_batches_hold_what_was_asked_and_can_be_fetched_again(self, tier_case: TierCase):
        tier = tier_case.tier
        for want, expected in tier_case.has:
            served = tier_case.run(tier.fetch(want))
            assert isinstance(served, Served) and (served.batch is not None) is tier_case.batches, want
            batch = served.batch
            if batch is None:
                with pytest.raises(CacheFSError):
                    tier_case.run(tier.fetch_batch(want.ds, BatchRef(want.ds.ref.id, tier.name, 0, 0, want.length, None), None))
                continue
            assert bytes(batch.member(want.okey) or b"") == expected
            view = memoryview(batch.data)
            for _okey, offset, length, checksum in batch.members:
                assert block_checksum(view[offset - batch.start:offset - batch.start + length]) == checksum
            refs = [BatchRef(batch.ds_id, tier.name, batch.pack, batch.window, len(batch.data), None), *tier.batches_after(batch)]
            for ref in refs:
                assert ref.ds_id == want.ds.ref.id and ref.tier == tier.name and ref.nbytes > 0
                again = tier_case.run(tier.fetch_batch(want.ds, ref, None))
                assert isinstance(again, MirrorWindow)
                assert (again.pack, again.window, len(again.data)) == (ref.pack, ref.window, ref.nbytes)

    def test_nothing_stays_in_flight_after_a_drain(self, tier_case: TierCase):
        async def fetch_then_drain() -> list[asyncio.Future]:
            await asyncio.gather(*(tier_case.tier.fetch(w) for w, _ in tier_case.has))
            await tier_case.tier.drain()
            return tier_case.tier.stop()

        left = tier_case.run(fetch_then_drain())
        assert isinstance(left, list) and all(f.done() for f in left), left

    def test_a_dataset_it_serves_has_no_problem(self, tier_case: TierCase):
        for want, _expected in tier_case.has:
            tier_case.run(tier_case.tier.fetch(want))
            assert tier_case.tier.problem(want.ds.ref.id) is None

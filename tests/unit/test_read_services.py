"""The shared services under the read paths: single-flight, memory reservations, the tier chain."""

from __future__ import annotations

import asyncio

import pytest

from cachefs.base.errors import CacheFSError, ObjectNotFoundError
from cachefs.base.types import Entry
from cachefs.node.budget import MemoryBudget
from cachefs.node.flight import SingleFlight
from cachefs.tiers import Keep, Served, Tier, TierChain, TierCounts, Want


def test_single_flight_runs_once_per_key_and_forgets_it_after():
    async def scenario():
        flight, runs = SingleFlight(), []

        async def work(key):
            runs.append(key)
            await asyncio.sleep(0.01)
            return key * 2

        futs = [flight.join("a", lambda: work("a")) for _ in range(5)]
        assert [started for _, started in futs] == [True, False, False, False, False]
        assert await asyncio.gather(*(f for f, _ in futs)) == ["aa"] * 5
        assert runs == ["a"] and "a" not in flight
        f, started = flight.join("a", lambda: work("a"))  # finished: a new run
        assert started and await f == "aa" and runs == ["a", "a"]

    asyncio.run(scenario())


def test_single_flight_shares_an_error_with_every_waiter():
    async def scenario():
        flight = SingleFlight()

        async def fail():
            await asyncio.sleep(0)
            raise ObjectNotFoundError("gone")

        futs = [flight.join("k", fail)[0] for _ in range(3)]
        got = await asyncio.gather(*futs, return_exceptions=True)
        assert all(isinstance(g, ObjectNotFoundError) for g in got) and len(flight) == 0

    asyncio.run(scenario())


def test_a_reservation_is_released_once_and_waiters_get_room():
    async def scenario():
        budget = MemoryBudget(100)
        r = await budget.take(80)
        assert budget.try_take(30) is None and budget.used == 80
        waiter = asyncio.ensure_future(budget.take(30))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await r.release()
        await r.release()  # twice: nothing more is given back
        got = await asyncio.wait_for(waiter, 1)
        assert budget.used == 30
        async with got:
            pass
        assert budget.used == 0 and budget.peak == 80
        big = budget.try_take(1000)  # larger than the whole budget: admitted alone, so nothing deadlocks
        assert big is not None and budget.try_take(1) is None
        await big.release()

    asyncio.run(scenario())


class _Tier(Tier):
    def __init__(self, name: str, answer):
        self.name, self.answer, self.asked = name, answer, 0

    @classmethod
    def build(cls, parts, kind):
        return None

    async def fetch(self, want: Want):
        self.asked += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return None if self.answer is None else Served(self.answer, self.name)


def _want(length: int = 3) -> Want:
    return Want(None, Entry("f", length, "v1", 0.0), b"k" * 16, 0, length)


def test_the_chain_asks_in_order_counts_what_each_served_and_every_fallback():
    async def scenario():
        counts = TierCounts()
        peer, mirror, origin = _Tier("peer", CacheFSError("peer down")), _Tier("mirror", None), _Tier("origin", b"abc")
        chain = TierChain([peer, mirror, origin], counts)
        served = await chain.fetch(_want())
        assert (served.data, served.tier, served.keep) == (b"abc", "origin", Keep.OWN)
        assert (peer.asked, mirror.asked, origin.asked) == (1, 1, 1)
        served, fallbacks = counts.snapshot()
        assert served == {"origin": 3} and fallbacks == {("peer", "CacheFSError"): 1}
        mirror.answer = b"xyz"
        assert (await chain.fetch(_want())).data == b"xyz" and origin.asked == 1
        assert counts.snapshot()[0] == {"origin": 3, "mirror": 3}

    asyncio.run(scenario())


def test_the_last_tiers_error_is_the_readers():
    async def scenario():
        chain = TierChain([_Tier("mirror", None), _Tier("origin", ObjectNotFoundError("no such key"))], TierCounts())
        with pytest.raises(ObjectNotFoundError):
            await chain.fetch(_want())

    asyncio.run(scenario())

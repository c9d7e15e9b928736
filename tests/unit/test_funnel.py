"""The origin funnel serves readers first: read-ahead never holds a GET slot a reader waits for, a reader that
comes for a read-ahead fetch takes it along, and small read-ahead GETs are held to what the origin takes."""

from __future__ import annotations

import asyncio

from cachefs.node import speculation
from cachefs.node.flight import SingleFlight
from cachefs.node.funnel import AheadLimit, OriginFunnel


class GatedSource:
    """A source whose GETs finish when the test says, in the order they started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    async def read(self, url, version, start, end):
        self.started.append(url)
        gate = self.gates.setdefault(url, asyncio.Event())
        await gate.wait()
        return b"x" * (end - start)

    def finish(self, url: str) -> None:
        self.gates.setdefault(url, asyncio.Event()).set()


async def _until(predicate) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


async def _ahead(funnel, source, url):
    with speculation.speculating():
        return await funnel.get(source, url, "v", 0, 10)


def test_a_freed_slot_goes_to_the_waiting_reader_and_read_ahead_waits_behind_it():
    async def scenario():
        funnel, source = OriginFunnel(1 << 20, 2, 1 << 20), GatedSource()
        funnel.ahead_limit.limit = 2
        busy = [asyncio.ensure_future(_ahead(funnel, source, f"ahead-{i}")) for i in range(2)]
        await _until(lambda: len(source.started) == 2)
        queued_ahead = asyncio.ensure_future(_ahead(funnel, source, "ahead-late"))
        await _until(lambda: len(funnel._ahead) == 1)
        reader = asyncio.ensure_future(funnel.get(source, "reader", "v", 0, 10))
        await _until(lambda: len(funnel._readers) == 1)
        source.finish("ahead-0")
        await _until(lambda: len(source.started) == 3)
        assert source.started[2] == "reader"  # queued after the read-ahead, started before it
        source.finish("reader")
        assert await reader == b"x" * 10
        await _until(lambda: len(source.started) == 4)
        assert source.started[3] == "ahead-late"
        for url in ("ahead-1", "ahead-late"):
            source.finish(url)
        await asyncio.gather(*busy, queued_ahead)
        assert funnel.in_flight == 0

    asyncio.run(scenario())


def test_read_ahead_starts_nothing_while_a_reader_waits_for_a_slot():
    async def scenario():
        funnel, source = OriginFunnel(1 << 20, 1, 1 << 20), GatedSource()
        first = asyncio.ensure_future(funnel.get(source, "reader-1", "v", 0, 10))
        await _until(lambda: source.started == ["reader-1"])
        second = asyncio.ensure_future(funnel.get(source, "reader-2", "v", 0, 10))
        ahead = asyncio.ensure_future(_ahead(funnel, source, "ahead"))
        await _until(lambda: len(funnel._readers) == 1 and len(funnel._ahead) == 1)
        source.finish("reader-1")
        await _until(lambda: len(source.started) == 2)
        assert source.started == ["reader-1", "reader-2"]
        source.finish("reader-2")
        source.finish("ahead")
        await asyncio.gather(first, second, ahead)
        assert source.started == ["reader-1", "reader-2", "ahead"]

    asyncio.run(scenario())


def test_a_reader_sharing_a_read_ahead_fetch_moves_it_ahead_of_other_read_ahead():
    async def scenario():
        funnel, source, flight = OriginFunnel(1 << 20, 1, 1 << 20), GatedSource(), SingleFlight()
        blocker = asyncio.ensure_future(_ahead(funnel, source, "ahead-0"))
        await _until(lambda: source.started == ["ahead-0"])

        def start_ahead(url):
            with speculation.speculating():
                return flight.start(url, funnel.get(source, url, "v", 0, 10))

        first, wanted = start_ahead("ahead-1"), start_ahead("ahead-2")
        await _until(lambda: len(funnel._ahead) == 2)
        shared = flight.get("ahead-2")  # a reader comes for the second one
        assert shared is wanted and len(funnel._readers) == 1 and len(funnel._ahead) == 1
        source.finish("ahead-0")
        await _until(lambda: len(source.started) == 2)
        assert source.started[1] == "ahead-2"
        for url in ("ahead-2", "ahead-1"):
            source.finish(url)
        await asyncio.gather(blocker, first, wanted)

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_no_slot_taken():
    async def scenario():
        funnel, source = OriginFunnel(1 << 20, 1, 1 << 20), GatedSource()
        first = asyncio.ensure_future(funnel.get(source, "reader-1", "v", 0, 10))
        await _until(lambda: source.started == ["reader-1"])
        waiting = [asyncio.ensure_future(funnel.get(source, "reader-2", "v", 0, 10)),
                   asyncio.ensure_future(_ahead(funnel, source, "ahead"))]
        await _until(lambda: funnel._readers and funnel._ahead)
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        source.finish("reader-1")
        await first
        assert funnel.in_flight == 0 and not funnel._readers and not funnel._ahead
        source.finish("reader-3")
        assert await funnel.get(source, "reader-3", "v", 0, 10) == b"x" * 10

    asyncio.run(scenario())


def test_the_read_ahead_limit_shrinks_as_the_origin_queues_and_grows_while_it_does_not():
    def settle(rtt_of) -> float:
        limit = AheadLimit(64)
        for i in range(400):
            n = 1 if i % 5 == 0 else 1 + int(limit.limit)  # now and then the reader's GET alone
            limit.note(rtt_of(n), n)
        return limit.limit

    assert settle(lambda n: 0.010) == 64  # a far origin: as fast with many in flight as with one
    assert settle(lambda n: 0.0015 * n) <= 3  # bound by its CPU: each GET in flight adds its time

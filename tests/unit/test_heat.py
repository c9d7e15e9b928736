"""Hot directories: the owner's decaying rates, and readers spreading over the holders it announces."""

from __future__ import annotations

import asyncio
import collections

import pytest

from cachefs.base.config import MAX_REPLICAS, ClusterConfig, parse_replicas
from cachefs.base.errors import ConfigError
from cachefs.base.types import DatasetRef, Entry
from cachefs.cluster.heat import HeatTracker, hot_bytes_per_s
from cachefs.cluster.keys import ASKED_AS_REPLICA, block_key
from cachefs.cluster.membership import MemberTable, parse_peers
from cachefs.cluster.placement import RANK
from cachefs.tiers import Keep
from cachefs.tiers.base import Want
from cachefs.tiers.peer import PeerTier


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_directory_turns_hot_past_the_threshold_stays_hot_while_spread_and_cools_below_half():
    clock = Clock()
    heat = HeatTracker(hot_requests=100, hot_bytes=10**12, replicas=2, tau=10.0, clock=clock)
    # 50 requests/s: a rate of 50 settles well below 100.
    for _ in range(200):
        clock.t += 0.02
        assert heat.note("ds", "a", 1000) == 0
    # 200 requests/s: hot within a few seconds.
    hot_after = None
    for i in range(2000):
        clock.t += 0.005
        if heat.note("ds", "a", 1000):
            hot_after = i
            break
    assert hot_after is not None
    assert heat.replicas_of("ds", "a") == 2
    [k] = heat.hot()
    assert (k.dataset, k.directory, k.replicas) == ("ds", "a", 2)
    # Spread over three holders, this one sees a third (70/s): the group-wide estimate (210/s) keeps it hot.
    for _ in range(1000):
        clock.t += 1 / 70
        assert heat.note("ds", "a", 1000) == 2
    # Traffic falls to 10/s here (30/s estimated, under half the threshold): it cools.
    for _ in range(300):
        clock.t += 0.1
        heat.note("ds", "a", 1000)
    assert heat.replicas_of("ds", "a") == 0 and heat.hot() == []
    # Bytes alone make a directory hot too; a directory nobody asks for cools when read.
    big = HeatTracker(hot_requests=10**6, hot_bytes=50e6, replicas=1, tau=1.0, clock=clock)
    for _ in range(200):
        clock.t += 0.01
        big.note("ds", "b", 1 << 20)
    assert [k.directory for k in big.hot()] == ["b"]
    clock.t += 30
    assert big.hot() == []
    assert big.served_requests == 200 and big.served_bytes == 200 << 20


def test_heat_memory_is_bounded_and_zero_replicas_never_spreads():
    clock = Clock()
    heat = HeatTracker(hot_requests=1, hot_bytes=1, replicas=0, max_keys=100, clock=clock)
    for i in range(1000):
        clock.t += 0.001
        assert heat.note("ds", f"d{i}", 10) == 0
    assert len(heat._keys) <= 100
    with pytest.raises(ValueError):
        HeatTracker(hot_requests=0, hot_bytes=1, replicas=1)


def test_replicas_settings_are_checked_and_the_nic_gives_the_byte_threshold(tmp_path):
    assert parse_replicas("s3://b/hot=2, s3://b=1") == [("s3://b/hot", 2), ("s3://b", 1)]
    for bad in ("s3://b", "s3://b=0", f"s3://b={MAX_REPLICAS + 1}", "b=1", "s3://b=x"):
        with pytest.raises(ConfigError):
            parse_replicas(bad)
    assert MAX_REPLICAS == RANK - 1  # replicas are the candidates placement keeps
    for name, speed in (("lo", "100000"), ("eth0", "25000"), ("eth1", "-1"), ("veth0", "garbage")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "speed").write_text(speed + "\n")
    assert hot_bytes_per_s(ClusterConfig(), str(tmp_path)) == 25_000 * 10**6 // 8 // 4
    assert hot_bytes_per_s(ClusterConfig(), str(tmp_path / "none")) == 10_000 * 10**6 // 8 // 4
    assert hot_bytes_per_s(ClusterConfig(hot_bytes_per_s="1MB"), str(tmp_path)) == 10**6


# -- readers spreading --------------------------------------------------------------------------------------
class FakeClient:
    """Answers every block at once, announcing ``hot`` replicas when the owner answers."""

    def __init__(self, owner_says: int = 0) -> None:
        self.asked: list[tuple[str, bool, bool]] = []
        self.owner_says = owner_says
        self.owner = ""
        #: Members that hold nothing: asked without a fetch, they answer None (a 404).
        self.empty: set[str] = set()

    async def block(self, address, ds_id, url, path, version, idx, length, *, fetch=True, replica=False):
        name = address.rpartition(":")[0]
        self.asked.append((name, fetch, replica))
        if not fetch and name in self.empty:
            return None, 0
        return b"x" * length, (self.owner_says if name == self.owner else 0)


class FakeGroup:
    def __init__(self, names: list[str], self_name: str = "r", *, serving: bool = False) -> None:
        self.table = MemberTable(self_name)
        self.table.update(parse_peers(",".join(f"{n}={n}:1" for n in names)))
        self.client = FakeClient()
        self.serving = serving


class FakeDataset:
    def __init__(self, url: str) -> None:
        self.ref = DatasetRef.from_url(url)


def want(ds, i: int = 0) -> Want:
    e = Entry(path=f"hot/{i}.bin", size=4096, version="e1", mtime=0.0)
    return Want(ds, e, b"k" * 15 + bytes([i % 256]), 0, 4096)


def owner_of(group, w: Want) -> str:
    return group.table.placement.owner(block_key(w.okey, 0))


def test_readers_spread_a_hot_directory_over_its_holders_and_return_to_the_owner_when_it_cools():
    names = [f"n{i}" for i in range(8)]
    group = FakeGroup(names)
    clock = Clock()
    tier = PeerTier(group, kind="block", block_size=4096, clock=clock)
    ds = FakeDataset("s3://b/ds")
    w = want(ds)
    owner = owner_of(group, w)
    group.client.owner = owner
    holders = group.table.placement.owners(block_key(w.okey, 0), 3)

    async def reads(n: int) -> collections.Counter:
        group.client.asked.clear()
        for _ in range(n):
            served = await tier.fetch(w)
            assert served is not None and served.data == b"x" * 4096 and served.keep is Keep.GUEST
        return collections.Counter(a for a, _, _ in group.client.asked)

    assert asyncio.run(reads(50)) == {owner: 50}  # not hot: the owner only
    group.client.owner_says = 2
    asyncio.run(reads(1))  # the owner says it is hot now
    got = asyncio.run(reads(600))
    assert set(got) == set(holders), got
    assert got[owner] < 300 and min(got.values()) > 100, got  # about a third each
    assert all(replica == (a != owner) for a, _, replica in group.client.asked)  # replicas are asked as such
    assert all(fetch for _, fetch, _ in group.client.asked)
    # The owner stops saying so: the next answer from it ends the spreading.
    group.client.owner_says = 0
    asyncio.run(reads(100))
    assert asyncio.run(reads(30)) == {owner: 30}
    # Said once and never again: forgotten after HOT_TTL.
    group.client.owner_says = 2
    asyncio.run(reads(1))
    group.client.owner = "nobody"
    clock.t += 11
    assert asyncio.run(reads(30)) == {owner: 30}


def test_declared_replicas_spread_from_the_first_read_and_only_under_their_prefix():
    group = FakeGroup([f"n{i}" for i in range(8)])
    tier = PeerTier(group, kind="block", block_size=4096, declared=parse_replicas("s3://b/ds/hot=3"))
    w_hot, w_cold = want(FakeDataset("s3://b/ds")), want(FakeDataset("s3://b/other"))
    for w, spread in ((w_hot, 4), (w_cold, 1)):
        group.client.asked.clear()
        for _ in range(400):
            asyncio.run(tier.fetch(w))
        assert len({a for a, _, _ in group.client.asked}) == spread


def test_the_agent_asks_peers_only_as_a_replica_and_only_those_ranked_before_it():
    names = [f"n{i}" for i in range(6)]
    w = want(FakeDataset("s3://b/ds"))
    ranked = FakeGroup(names).table.placement.owners(block_key(w.okey, 0))
    for rank, me in enumerate(ranked):
        group = FakeGroup(names, me, serving=True)
        tier = PeerTier(group, kind="block", block_size=4096)
        group.client.empty = set(names)  # no member holds it: the agent fetches it itself
        assert asyncio.run(tier.fetch(w)) is None
        assert not any(fetch for _, fetch, _ in group.client.asked)  # (members were only asked what they hold)
        group.client.asked.clear()

        async def as_replica(tier=tier):
            ASKED_AS_REPLICA.set(True)
            return await tier.fetch(w)

        got = asyncio.run(as_replica())
        fetching = [a for a, fetch, _ in group.client.asked if fetch]
        if rank == 0:
            assert got is None and fetching == []  # the owner goes to the origin (after asking for copies only)
        else:
            assert got.data == b"x" * 4096 and fetching == [ranked[0]]  # from the owner, which alone fetches
            assert got.keep is Keep.GUEST  # the agent keeps what a replica brings, as guest data
            assert not any(replica for _, _, replica in group.client.asked)


def test_an_owner_that_misses_takes_a_copy_a_member_holds_before_the_origin_and_a_cold_dataset_goes_straight_on():
    """After a member died (or joined), the keys that moved are mostly still in the group: the agent that now owns
    one asks members whether they hold it (never to fetch: one origin read per group), keeps what one sends as its
    own, and skips the asking for a dataset whose asks keep missing (a first epoch)."""
    from cachefs.cluster.keys import ASKED_BY
    from cachefs.tiers.peer import COLD_AFTER, HOLDER_ASKS

    names = [f"n{i}" for i in range(12)]
    clock = Clock()
    group = FakeGroup(names, "n0", serving=True)
    tier = PeerTier(group, kind="block", block_size=4096, clock=clock)
    ds = FakeDataset("s3://b/ds")
    group.client.empty = set(names[:-3])  # three members kept a guest copy

    async def as_asked_by(member: str, w: Want):
        ASKED_BY.set(member)
        return await tier.fetch(w)

    served = asyncio.run(as_asked_by("n3", want(ds, 1)))
    asked = [a for a, _, _ in group.client.asked]
    assert "n0" not in asked and "n3" not in asked and len(asked) == min(HOLDER_ASKS, len(names) - 2)
    assert not any(fetch or replica for _, fetch, replica in group.client.asked)
    holders_asked = set(asked) & set(names[-3:])
    assert (served is not None) == bool(holders_asked)
    if served is not None:
        assert served.data == b"x" * 4096 and served.keep is Keep.OWN
    group.client.empty = set(names)  # a cold dataset: nobody holds anything
    # Keys this node owns first (a key it fetches in place of a down owner is always asked about).
    own = (w for w in (want(ds, i) for i in range(100, 100_000))
           if group.table.placement.owner(block_key(w.okey, 0)) == "n0")
    for _ in range(COLD_AFTER):
        assert asyncio.run(as_asked_by("n3", next(own))) is None
    group.client.asked.clear()
    assert asyncio.run(as_asked_by("n3", next(own))) is None and group.client.asked == []  # cold: no asks
    clock.t += 31
    asyncio.run(as_asked_by("n3", next(own)))
    assert group.client.asked  # asked again once the cold spell is over

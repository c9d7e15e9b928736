"""Table-driven tests of the pure scoring functions."""

from __future__ import annotations

import pytest

from scheduler_hints.labels import NodeCacheView
from scheduler_hints.scoring import (
    NodeState,
    PodNeeds,
    Weights,
    combine,
    gpu_packing,
    group_best,
    locality,
    topology_affinity,
)

A, B = "a" * 16, "b" * 16


def node(name, fractions=None, group=None, labels=None, alloc=0, free=0):
    return NodeState(name, NodeCacheView(name, fractions or {}, {}, group), labels or {}, alloc, free)


@pytest.mark.parametrize(("needs", "n", "want"), [
    (PodNeeds({}), node("n"), None),  # no data: no signal
    (PodNeeds({A: 0}), node("n"), 0.0),  # label missing: nothing cached
    (PodNeeds({A: 0}), node("n", {A: 0.9}), 0.9),
    (PodNeeds({A: 300, B: 100}), node("n", {A: 1.0}), 0.75),  # byte-weighted
    (PodNeeds({A: 0, B: 0}), node("n", {A: 1.0}), 0.5),  # unknown sizes: equal weights
])
def test_locality(needs, n, want):
    got = locality(needs, n)
    assert got == (None if want is None else pytest.approx(want))


def test_locality_domain_credit_is_smaller_than_local():
    peer = node("p", {A: 1.0}, group="rack-1")
    same_group = node("n", {}, group="rack-1")
    other_group = node("m", {}, group="rack-2")
    holder = node("h", {A: 1.0}, group="rack-1")
    needs = PodNeeds({A: 0})
    peers = [peer, same_group, other_group, holder]
    groups = group_best(peers)
    assert locality(needs, holder, groups) == 1.0
    assert locality(needs, same_group, groups) == pytest.approx(Weights().domain)
    assert locality(needs, other_group, groups) == 0.0
    alone = node("solo", {A: 1.0}, group="rack-9")
    assert locality(needs, alone, group_best([alone])) == 1.0  # its own copy is not peer credit


@pytest.mark.parametrize(("gpus", "alloc", "free", "want"), [
    (0, 8, 8, None), (8, 8, 8, 1.0), (4, 8, 4, 1.0), (4, 8, 8, 0.5), (2, 8, 8, 0.25), (4, 8, 2, 0.0), (1, 0, 0, 0.0),
])
def test_gpu_packing(gpus, alloc, free, want):
    assert gpu_packing(PodNeeds(gpus=gpus), node("n", alloc=alloc, free=free)) == want


def test_topology_prefers_same_clique_then_leaf():
    levels = Weights().topology_levels
    placed = [node("p", labels={levels[0]: "c1", levels[1]: "leaf1"})]
    same_clique = node("a", labels={levels[0]: "c1", levels[1]: "leaf1"})
    same_leaf = node("b", labels={levels[0]: "c2", levels[1]: "leaf1"})
    elsewhere = node("c", labels={levels[0]: "c3", levels[1]: "leaf2"})
    scores = [topology_affinity(n, placed) for n in (same_clique, same_leaf, elsewhere)]
    assert scores[0] > scores[1] > scores[2] == 0.0
    assert topology_affinity(elsewhere, []) is None  # not a gang


def test_first_gang_member_prefers_a_domain_that_fits_the_whole_gang():
    k = Weights().topology_levels[0]
    cluster = [node("a1", labels={k: "c1"}, alloc=8, free=8), node("a2", labels={k: "c1"}, alloc=8, free=8),
               node("b1", labels={k: "c2"}, alloc=8, free=8), node("b2", labels={k: "c2"}, alloc=8, free=0)]
    fits = topology_affinity(cluster[0], [], cluster=cluster, gang_gpus=16)
    too_small = topology_affinity(cluster[2], [], cluster=cluster, gang_gpus=16)
    assert fits == 1.0 and too_small == 0.0


@pytest.mark.parametrize(("parts", "want"), [
    ({"locality": None, "packing": None, "topology": None}, 0),  # no valid score: neutral
    ({"locality": 1.0}, 10), ({"locality": 0.0}, 0), ({"locality": 0.5}, 5),
    ({"locality": 1.0, "packing": 0.0}, 7),  # 1.0 / 1.5
    ({"locality": 2.0}, 10), ({"locality": -1.0}, 0),  # clamped
])
def test_combine(parts, want):
    assert combine(parts) == want


def test_gang_first_member_prefers_the_domain_holding_the_data():
    from scheduler_hints.labels import NodeCacheView
    from scheduler_hints.scoring import NodeState, PodNeeds, Weights, first_member_locality, gang_domain_locality

    w = Weights(topology_levels=("clique",))

    def node(name, clique, frac, free=8):
        return NodeState(name, NodeCacheView(name, {"d": frac} if frac else {}), {"clique": clique}, 8, free)

    # Clique a: two nodes full of data; clique b: nothing cached. Both can hold a 2-pod gang.
    cluster = [node("a1", "a", 1.0), node("a2", "a", 0.8), node("b1", "b", 0.0), node("b2", "b", 0.0),
               node("c1", "c", 1.0, free=0)]  # c holds data but has no room: not a candidate domain
    needs = PodNeeds({"d": 100}, 8)
    by_domain = gang_domain_locality(needs, cluster, 2, None, w)
    assert by_domain == {("clique", "a"): 0.9, ("clique", "b"): 0.0}
    # A data-less node in the data-rich clique beats a data-less node in the empty clique.
    a_empty = node("a3", "a", 0.0)
    assert first_member_locality(0.0, a_empty, by_domain, w) == 0.45
    assert first_member_locality(0.0, cluster[2], by_domain, w) == 0.0
    assert first_member_locality(None, a_empty, by_domain, w) is None  # no data needs: no signal
    assert gang_domain_locality(PodNeeds({}, 8), cluster, 2, None, w) == {}

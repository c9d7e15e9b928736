"""Table-driven tests of the pure scoring functions."""

from __future__ import annotations

import pytest

from scheduler_hints.labels import NodeCacheView
from scheduler_hints.scoring import (
    NodeState,
    PodNeeds,
    Weights,
    best_slots_locality,
    combine,
    defer_for_locality,
    gang_domain_locality,
    gpu_packing,
    group_fractions,
    locality,
    locality_scorer,
    score_nodes,
    whole_nodes_short,
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
    groups = group_fractions(peers)
    assert locality(needs, holder, groups) == 1.0
    assert locality(needs, same_group, groups) == pytest.approx(Weights().domain)
    assert locality(needs, other_group, groups) == 0.0
    alone = node("solo", {A: 1.0}, group="rack-9")
    assert locality(needs, alone, group_fractions([alone])) == 1.0  # its own copy is not peer credit


@pytest.mark.parametrize(("gpus", "alloc", "free", "want"), [
    (0, 8, 8, None), (8, 8, 8, 1.0), (4, 8, 4, 1.0), (4, 8, 8, 0.5), (2, 8, 8, 0.25), (4, 8, 2, 0.0), (1, 0, 0, 0.0),
])
def test_gpu_packing(gpus, alloc, free, want):
    assert gpu_packing(PodNeeds(gpus=gpus), node("n", alloc=alloc, free=free)) == want


def test_small_pods_fill_holes_only_while_whole_node_pods_wait():
    needs = PodNeeds({A: 0}, gpus=1)
    holder_whole = node("holder", {A: 1.0}, alloc=8, free=8)  # holds the data, but is a whole free node
    hole = node("hole", alloc=8, free=1)  # holds nothing, one GPU free on a busy node
    score = locality_scorer(needs, group_fractions([holder_whole, hole]))
    calm = score_nodes(needs, [holder_whole, hole], score)
    short = score_nodes(needs, [holder_whole, hole], score, whole_nodes_short=True)
    assert calm[0] > calm[1]  # nobody needs whole nodes: the data wins
    assert short[1] > short[0]  # whole-node pods wait: fill the hole, keep the whole node
    assert score_nodes(needs, [holder_whole], score, Weights(packing_when_short=0.5), whole_nodes_short=True) == \
        score_nodes(needs, [holder_whole], score)  # the weight is configurable


@pytest.mark.parametrize(("gpus", "free", "hole_fit", "want"), [
    (1, 8, 0.25, 0.0),  # a whole free node: kept whole while whole-node pods wait
    (1, 1, 0.25, 1.0),  # fills the hole exactly
    (1, 7, 0.25, 1.0 - 0.25 * 6 / 8),  # a loose hole is still far better than a whole node
    (1, 7, 1.0, 0.25),  # hole_fit 1: as tight as packing when whole nodes are not short
    (1, 7, 0.0, 1.0),  # hole_fit 0: every hole alike
    (4, 2, 0.25, 0.0),  # does not fit
    (0, 8, 0.25, None),  # no GPUs: no signal
])
def test_gpu_packing_while_whole_nodes_are_short(gpus, free, hole_fit, want):
    got = gpu_packing(PodNeeds(gpus=gpus), node("n", alloc=8, free=free), hole_fit=hole_fit)
    assert got == (None if want is None else pytest.approx(want))


def test_while_whole_nodes_are_short_data_chooses_among_holes():
    needs = PodNeeds({A: 0}, gpus=1)
    tight = node("tight", alloc=8, free=1)  # fits exactly, holds nothing
    loose = node("loose", {A: 1.0}, alloc=8, free=7)  # a loose hole that holds all the data
    whole = node("whole", {A: 1.0}, alloc=8, free=8)  # holds the data, but is a whole free node
    nodes = [tight, loose, whole]
    score = locality_scorer(needs, group_fractions(nodes))
    short = score_nodes(needs, nodes, score, whole_nodes_short=True)
    assert short[1] > short[0] > short[2]  # data among the holes; never the whole node
    tightest = score_nodes(needs, nodes, score, Weights(hole_fit_when_short=1.0), whole_nodes_short=True)
    assert tightest[0] > tightest[1] > tightest[2]  # hole_fit 1: the tightest hole wins over the data


def test_while_whole_nodes_are_short_holes_the_data_does_not_tell_apart_fill_tightest_first():
    needs = PodNeeds({A: 0}, gpus=1)
    tight = node("tight", {A: 0.3}, alloc=8, free=1)
    loose = node("loose", {A: 0.35}, alloc=8, free=7)  # a little more data: within the spread, not a preference
    whole = node("whole", {A: 0.35}, alloc=8, free=8)
    nodes = [tight, loose, whole]
    score = locality_scorer(needs)
    short = score_nodes(needs, nodes, score, whole_nodes_short=True)
    assert short[0] > short[1] > short[2]  # the tightest hole, and still never the whole node
    data_counts = score_nodes(needs, nodes, score, Weights(hole_data_spread=0.0), whole_nodes_short=True)
    assert data_counts[1] > short[1] and data_counts[0] == short[0]  # any spread counts: loose holes fit as
    # well as hole_fit_when_short says, tight ones are unchanged


@pytest.mark.parametrize(("free", "loc", "want"), [
    ([1, 7, 8], [0.3, 0.35, 1.0], 1.0),  # the holes' data spreads by 0.05 < 0.1 (the whole node does not count)
    ([1, 7, 8], [0.0, 1.0, 1.0], 0.25),  # one hole holds the data: it chooses
    ([1, 7], None, 1.0),  # no data at all: nothing to choose by
    ([8, 8], [0.0, 1.0], 1.0),  # no holes: no choice among them to make
    ([0, 7, 3], [1.0, 0.2, 0.25], 1.0),  # a full node is not a hole the pod fits
    ([2, 7], [float("nan"), 0.5], 0.25),  # no signal on a node counts as nothing cached
])
def test_short_hole_fit(free, loc, want):
    import numpy as np

    from scheduler_hints.scoring import short_hole_fit

    column = None if loc is None else np.array(loc)
    assert short_hole_fit(1, np.array(free), np.full(len(free), 8), column) == want


@pytest.mark.parametrize(("pod_gpus", "waiting_whole", "whole_free", "want"), [
    (1, 2, 1, True),  # more whole-node pods wait than there are whole free nodes
    (1, 1, 1, False),  # they all fit
    (1, 0, 0, False),  # nobody waits for a whole node
    (8, 5, 0, False),  # a whole-node pod itself: packing cannot help it
    (0, 5, 0, False),  # no GPUs: no packing signal
])
def test_whole_nodes_short(pod_gpus, waiting_whole, whole_free, want):
    assert whole_nodes_short(pod_gpus, 8, waiting_whole, whole_free) is want


ONLY_TOPOLOGY = Weights(local=0, packing=0, topology=1)


def test_topology_prefers_same_clique_then_leaf():
    levels = Weights().topology_levels
    placed = [node("p", labels={levels[0]: "c1", levels[1]: "leaf1"})]
    same_clique = node("a", labels={levels[0]: "c1", levels[1]: "leaf1"})
    same_leaf = node("b", labels={levels[0]: "c2", levels[1]: "leaf1"})
    elsewhere = node("c", labels={levels[0]: "c3", levels[1]: "leaf2"})
    nodes = [placed[0], same_clique, same_leaf, elsewhere]
    needs = PodNeeds(gpus=8)
    scores = score_nodes(needs, nodes, lambda n: None, ONLY_TOPOLOGY, gang_size=3, placed=placed)
    assert scores == [10, 10, 8, 0]  # its own node, same clique, same leaf (1 - 1/4), elsewhere
    assert score_nodes(needs, nodes, lambda n: None, ONLY_TOPOLOGY) == [0, 0, 0, 0]  # not a gang: no signal


def test_first_gang_member_prefers_a_domain_that_fits_the_whole_gang():
    k = Weights().topology_levels[0]
    cluster = [node("a1", labels={k: "c1"}, alloc=8, free=8), node("a2", labels={k: "c1"}, alloc=8, free=8),
               node("b1", labels={k: "c2"}, alloc=8, free=8), node("b2", labels={k: "c2"}, alloc=8, free=0)]
    scores = score_nodes(PodNeeds(gpus=8), cluster, lambda n: None, ONLY_TOPOLOGY, gang_size=2, cluster=cluster)
    assert scores[:3] == [10, 10, 0]


@pytest.mark.parametrize(("parts", "want"), [
    ({"locality": None, "packing": None, "topology": None}, 0),  # no valid score: neutral
    ({"locality": 1.0}, 10), ({"locality": 0.0}, 0), ({"locality": 0.5}, 5),
    ({"locality": 1.0, "packing": 0.0}, 7),  # 1.0 / 1.5
    ({"locality": 2.0}, 10), ({"locality": -1.0}, 0),  # clamped
])
def test_combine(parts, want):
    assert combine(parts) == want


def test_gang_first_member_prefers_the_domain_holding_the_data():
    w = Weights(local=1, packing=0, topology=0, topology_levels=("clique",))

    def node(name, clique, frac, free=8):
        return NodeState(name, NodeCacheView(name, {"d": frac} if frac else {}), {"clique": clique}, 8, free)

    # Clique a: two nodes full of data; clique b: nothing cached. Both can hold a 2-pod gang.
    cluster = [node("a1", "a", 1.0), node("a2", "a", 0.8), node("b1", "b", 0.0), node("b2", "b", 0.0),
               node("c1", "c", 1.0, free=0)]  # c holds data but has no room: not a candidate domain
    needs = PodNeeds({"d": 100}, 8)
    by_domain = gang_domain_locality(needs, cluster, 2, None, w)
    assert by_domain == {("clique", "a"): 0.9, ("clique", "b"): 0.0}
    # A data-less node in the data-rich clique beats a data-less node in the empty clique: its own 0 averaged
    # with its clique's 0.9.
    a_empty, b_empty = node("a3", "a", 0.0), cluster[2]
    loc = locality_scorer(needs, None, w)
    assert score_nodes(needs, [a_empty, b_empty], loc, w, gang_size=2, cluster=cluster) == [round(4.5), 0]
    no_data = PodNeeds({}, 8)  # no data needs: no locality signal at all
    assert score_nodes(no_data, [a_empty], locality_scorer(no_data), w, gang_size=2, cluster=cluster) == [0]
    assert gang_domain_locality(no_data, cluster, 2, None, w) == {}


@pytest.mark.parametrize(("nodes", "count", "want"), [
    ([], 2, 0.0),  # no slots at all
    ([(0.9, 1), (0.5, 4)], 2, 0.7),  # the best slot, then the next node's
    ([(0.9, 2), (0.5, 4)], 2, 0.9),  # one node with two slots holds both pods
    ([(0.9, 0), (0.5, 4)], 1, 0.5),  # a node without a free slot does not count
    ([(None, 3), (0.4, 1)], 2, 0.2),  # no signal counts as nothing cached
    ([(1.0, 1)], 4, 0.25),  # too few slots: the missing ones read nothing locally
    ([(1.0, 1)], 0, 0.0),
])
def test_best_slots_locality(nodes, count, want):
    assert best_slots_locality(nodes, count) == pytest.approx(want)


@pytest.mark.parametrize(("achievable", "possible", "waited", "want"), [
    (0.1, 0.9, 0, True),  # the data is elsewhere, the wait has just begun
    (0.1, 0.9, 299, True),
    (0.1, 0.9, 300, False),  # waited long enough: run where there is room
    (0.75, 0.9, 0, False),  # within the slack: not worth waiting
    (0.9, 0.9, 0, False),
    (0.0, 0.0, 0, False),  # the data is nowhere: nothing to wait for
])
def test_defer_for_locality(achievable, possible, waited, want):
    assert defer_for_locality(achievable, possible, waited, wait=300, slack=0.2) is want


@pytest.mark.parametrize("seed", range(6))
def test_gang_domain_locality_is_the_best_slots_of_each_domain_that_fits(seed):
    """The one-pass computation equals, bit for bit, best_slots_locality over each domain's nodes (random
    clusters with mixed GPU counts, shared and partial data, nodes missing a topology label)."""
    import random

    rng = random.Random(seed)
    levels = ("clique", "leaf")
    cluster = []
    for i in range(rng.randint(1, 80)):
        labels = {"leaf": f"l{i // 16}"}
        if rng.random() < 0.9:
            labels["clique"] = f"c{i // 4}"
        alloc = rng.choice([4, 8])
        cluster.append(node(f"n{i}", {A: rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()])}, labels=labels,
                            alloc=alloc, free=rng.randint(0, alloc)))
    for gpus in (1, 2, 8):
        for gang in (1, 3, 8, 20):
            needs = PodNeeds({A: 0}, gpus=gpus)
            score = locality_scorer(needs)
            want = {}
            for key in levels:
                for value in {n.labels[key] for n in cluster if key in n.labels}:
                    members = [n for n in cluster if n.labels.get(key) == value]
                    if sum(n.gpu_free // gpus for n in members) >= gang:
                        want[(key, value)] = best_slots_locality([(score(n), n.gpu_free // gpus) for n in members], gang)
            got = gang_domain_locality(needs, cluster, gang, w=Weights(topology_levels=levels))
            assert got == want


@pytest.mark.parametrize("seed", range(4))
def test_first_gang_member_scores_match_a_per_node_reference(seed):
    """score_nodes for a gang's first member (computed over arrays) equals the rule applied node by node: the
    innermost domain with free GPUs for the whole gang gives the topology term, the innermost domain that can
    hold the gang gives the locality averaged in. Also for nodes outside the cluster's index, and whatever
    index the caller passes."""
    import random

    from scheduler_hints.scoring import domain_index

    rng = random.Random(seed)
    levels = ("clique", "leaf")
    w = Weights(topology_levels=levels)
    cluster = []
    for i in range(rng.randint(5, 60)):
        labels = {"leaf": f"l{i // 12}"} if rng.random() < 0.95 else {}
        if rng.random() < 0.9:
            labels["clique"] = f"c{i // 4}"
        cluster.append(node(f"n{i}", {A: rng.choice([0.0, 0.5, 1.0, rng.random()])}, labels=labels, alloc=8,
                            free=rng.choice([0, 2, 4, 8])))
    outsiders = [node("x1", {A: 0.7}, labels={"clique": "c-new", "leaf": "l0"}, alloc=8, free=8),
                 node("x2", labels={"leaf": "l-new"}, alloc=8, free=8)]
    nodes = cluster[::2] + outsiders
    for gpus, gang in ((8, 2), (2, 5), (4, 3)):
        needs = PodNeeds({A: 0}, gpus=gpus)
        score = locality_scorer(needs)
        free: dict = {}  # free GPUs per domain, summed here node by node
        for n in cluster:
            for key in levels:
                if key in n.labels:
                    free[(key, n.labels[key])] = free.get((key, n.labels[key]), 0) + n.gpu_free
        by_domain = gang_domain_locality(needs, cluster, gang, w=w)
        want = []
        for n in nodes:
            topology, loc = 0.0, score(n)
            mixed = False
            for depth, key in enumerate(levels):
                if key not in n.labels:
                    continue
                dom = (key, n.labels[key])
                if not mixed and dom in by_domain:
                    loc, mixed = (loc + by_domain[dom]) / 2, True
                if not topology and free.get(dom, 0) >= gang * gpus:
                    topology = 1.0 - depth / (len(levels) + 1)
            want.append(combine({"locality": loc, "packing": gpu_packing(needs, n), "topology": topology}, w))
        for index in (None, domain_index(cluster, levels), domain_index(cluster[1:], levels)):
            assert score_nodes(needs, nodes, score, w, gang_size=gang, cluster=cluster, index=index) == want


def test_domain_free_counts_gpus_or_pod_slots_per_domain():
    from scheduler_hints.scoring import domain_free, domain_index

    levels = ("clique", "leaf")
    cluster = [node("a", labels={"clique": "c1", "leaf": "l1"}, alloc=8, free=3),
               node("b", labels={"clique": "c1", "leaf": "l1"}, alloc=8, free=8),
               node("c", labels={"leaf": "l1"}, alloc=8, free=0),
               node("d", labels={"clique": "c2", "leaf": "l2"}, alloc=4, free=0)]
    want_free = {("clique", "c1"): 11, ("leaf", "l1"): 11}  # domains with nothing free are left out
    assert domain_free(cluster, levels) == want_free
    assert domain_free(cluster, levels, 4) == {("clique", "c1"): 2, ("leaf", "l1"): 2}  # whole 4-GPU pods
    assert domain_free(cluster, levels, 8, capacity=True) == {("clique", "c1"): 2, ("leaf", "l1"): 3}
    assert domain_free(cluster, levels, index=domain_index(cluster, levels)) == want_free
    assert domain_free(cluster, levels, index=domain_index(cluster[1:], levels)) == want_free  # not this cluster's


def test_a_group_that_shards_a_dataset_counts_as_holding_all_of_it():
    """Four nodes of a group each own a quarter of the dataset (a cache group keeps one copy between them): any
    node of the group reads the rest from its peers, which beats the origin; a node outside the group does not."""
    members = [node(f"r{i}", {A: 0.25}, group="rack-1") for i in range(4)]
    newcomer = node("r-new", {}, group="rack-1")
    outsider = node("o", {}, group="rack-2")
    groups = group_fractions([*members, newcomer, outsider])
    assert groups["rack-1"][A] == pytest.approx(1.0)
    needs = PodNeeds({A: 0})
    assert locality(needs, members[0], groups) == pytest.approx(0.25 + Weights().domain * 0.75)
    assert locality(needs, newcomer, groups) == pytest.approx(Weights().domain)
    assert locality(needs, outsider, groups) == 0.0
    assert locality(needs, members[0], groups) > locality(needs, newcomer, groups) > locality(needs, outsider, groups)


def test_a_gang_stays_inside_the_cache_group_holding_its_data_when_the_gpus_allow():
    """Two cache groups with room for the whole gang; group a shards the dataset (each member half of it). The
    first member picks group a (the cache group is the outermost topology level), the next ones stay there."""
    g = "cachefs.io/cache-group"
    assert Weights().topology_levels[-1] == g
    a = [node(f"a{i}", {A: 0.5}, group="rack-a", labels={g: "rack-a"}, alloc=8, free=8) for i in range(2)]
    b = [node(f"b{i}", {}, group="rack-b", labels={g: "rack-b"}, alloc=8, free=8) for i in range(3)]
    cluster = [*a, *b]
    needs = PodNeeds({A: 100}, 8)
    w = Weights()
    groups = group_fractions(cluster)
    loc = locality_scorer(needs, groups, w)
    first = score_nodes(needs, cluster, loc, w, gang_size=2, cluster=cluster)
    assert min(first[:2]) > max(first[2:]), first
    then = score_nodes(needs, [a[1], *b], loc, w, gang_size=2, placed=[a[0]])  # (a0 taken by the first)
    assert then[0] > max(then[1:]), then

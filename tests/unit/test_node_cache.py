"""The extender's node cache re-parses a node when it changes and only then."""

from __future__ import annotations

from scheduler_hints.labels import dataset_key
from scheduler_hints.node_cache import NodeCache

DS = "0123456789abcdef"


def node(rv: str, pct: str) -> dict:
    return {"metadata": {"name": "n1", "resourceVersion": rv, "labels": {dataset_key(DS): pct}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}}}


def test_updates_are_reparsed_and_unchanged_nodes_are_not():
    cache = NodeCache(refresh_interval=0)
    cache.update(node("1", "10"))
    assert cache.base_state(cache.nodes["n1"]).cache.fractions[DS] == 0.10
    gen = cache.generation
    cache.update(node("1", "10"))  # same version: same parse, no new generation
    assert cache.generation == gen
    cache.update(node("2", "90"))
    assert cache.base_state(cache.nodes["n1"]).cache.fractions[DS] == 0.90
    assert cache.generation > gen
    # A request's own copy of the node (full Node objects mode) is parsed by version too.
    assert cache.base_state(node("3", "50")).cache.fractions[DS] == 0.50
    cache.remove("n1")
    assert "n1" not in cache.nodes


def test_cluster_view_follows_changes_at_most_once_per_refresh_interval():
    now = [100.0]
    cache = NodeCache(refresh_interval=1.0, clock=lambda: now[0])
    cache.update(node("1", "10"))
    assert cache.cluster()[0][0].cache.fractions[DS] == 0.10  # the first change shows at once
    gen = cache.generation
    cache.update(node("2", "90"))
    now[0] += 0.5
    assert cache.generation == gen and cache.cluster()[0][0].cache.fractions[DS] == 0.10  # coalesced
    assert cache.base_state(cache.nodes["n1"]).cache.fractions[DS] == 0.90  # the node itself is current
    now[0] += 0.5
    assert cache.generation > gen and cache.cluster()[0][0].cache.fractions[DS] == 0.90
    cache.update({"metadata": {"name": "n2", "resourceVersion": "1"}})  # a new node shows at once
    assert [n.name for n in cache.cluster()[0]] == ["n1", "n2"]


def test_domain_index_follows_topology_labels_not_cache_labels():
    cache = NodeCache(refresh_interval=0)
    levels = ("rack",)

    def racked(name, rack, pct, rv):
        return {"metadata": {"name": name, "resourceVersion": rv, "labels": {"rack": rack, dataset_key(DS): pct}}}

    cache.update(racked("a", "r1", "10", "1"))
    cache.update(racked("b", "r1", "10", "1"))
    first = cache.domains(levels)
    assert first.members() == {("rack", "r1"): [0, 1]}
    cache.update(racked("a", "r1", "50", "2"))  # only the cache label changed: same index object
    assert cache.domains(levels) is first
    cache.update(racked("b", "r2", "10", "3"))  # moved racks
    assert cache.domains(levels).members() == {("rack", "r1"): [0], ("rack", "r2"): [1]}
    cache.remove("a")
    assert cache.domains(levels).members() == {("rack", "r2"): [0]}

"""The extender's node cache re-parses a node when it changes and only then."""

from __future__ import annotations

from scheduler_hints.extender import NodeCache
from scheduler_hints.labels import dataset_key

DS = "0123456789abcdef"


def node(rv: str, pct: str) -> dict:
    return {"metadata": {"name": "n1", "resourceVersion": rv, "labels": {dataset_key(DS): pct}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}}}


def test_updates_are_reparsed_and_unchanged_nodes_are_not():
    cache = NodeCache()
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

"""Decoding ExtenderArgs: nodes known at their resourceVersion are the extender's own copies, everything else
is decoded as sent, keys in any case, bad JSON is one clear error."""

from __future__ import annotations

import json

import pytest

from scheduler_hints.wire import BadJSON, decode_args, encode


def node(name: str, version: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": version, "labels": labels},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}}}


def test_known_nodes_are_the_cached_objects_and_changed_ones_are_decoded():
    cache = {"a": node("a", "1", zone="x"), "b": node("b", "5")}
    sent = [node("a", "1", zone="x"), node("b", "6", zone="new"), node("c", "1"), {"metadata": {"name": "d"}}]
    body = decode_args(json.dumps({"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": sent}}).encode(), cache.get)
    items = body["Nodes"]["items"]
    assert items == sent
    assert items[0] is cache["a"]  # same version: not decoded again
    assert items[1] is not cache["b"] and items[1]["metadata"]["labels"] == {"zone": "new"}
    assert body["Pod"] == {"metadata": {"name": "p"}}


@pytest.mark.parametrize("payload", [
    {"pod": {"a": 1}, "nodes": {"ITEMS": [node("a", "1")]}},  # Go's decoder matches keys in any case
    {"Pod": {}, "NodeNames": ["a", "b"], "Nodes": None},
    {"Pod": {}, "Nodes": {"items": [1, "x", None, {"metadata": 3}]}},  # odd shapes come through as sent
    {"Pod": {}, "Nodes": {"items": {"not": "a list"}}},
    [1, 2],
    "just a string",
])
def test_everything_else_is_decoded_as_sent(payload):
    cache = {"a": node("a", "1")}
    assert decode_args(json.dumps(payload).encode(), cache.get) == payload


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff", b"[" * 100_000 + b"]" * 100_000, b'{"Pod": 1} trailing'])
def test_bad_json_is_one_error(raw):
    with pytest.raises(BadJSON):
        decode_args(raw, {}.get)


def test_encode_round_trips():
    obj = {"Nodes": None, "NodeNames": ["a"], "FailedNodes": {"b": "no room"}, "Error": "", "Score": 10}
    assert json.loads(encode(obj)) == obj

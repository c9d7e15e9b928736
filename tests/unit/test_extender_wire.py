"""Decoding ExtenderArgs: nodes known at their resourceVersion are the extender's own copies, everything else
is decoded as sent, keys in any case, bad JSON is one clear error."""

from __future__ import annotations

import json

import pytest

from scheduler_hints.extender_wire import ArgsDecoder, BadJSON, NodeItems, NodeNames, as_sent, encode


def node(name: str, version: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": version, "labels": labels},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}}}


def decode_args(data: bytes, known):
    return ArgsDecoder(known).decode(data)


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


def test_nodes_keep_the_bytes_they_came_in_and_go_back_as_those_bytes():
    cache = {"a": node("a", "1")}
    sent = [node("a", "1"), node("b", "2", zone="y")]
    raw = json.dumps({"Pod": {}, "Nodes": {"metadata": {}, "items": sent}, "NodeNames": None}).encode()
    body = decode_args(raw, cache.get)
    items = body["Nodes"]["items"]
    assert isinstance(items, NodeItems) and items == sent and items[0] is cache["a"]
    assert body["Nodes"]["metadata"] == {} and body["NodeNames"] is None
    reply = encode({"Nodes": {"items": as_sent(items)}})
    assert json.loads(reply)["Nodes"]["items"] == sent
    assert reply == b'{"Nodes":{"items":[' + b",".join(json.dumps(n).encode() for n in sent) + b"]}}"
    assert as_sent(items[:1]) == [cache["a"]]  # a subset is encoded as objects


def test_the_same_node_list_is_decoded_once():
    cache: dict = {}
    decoder = ArgsDecoder(cache.get)
    sent = [node("a", "1"), node("b", "1")]
    first = decoder.decode(json.dumps({"Pod": {"n": 1}, "Nodes": {"items": sent}}).encode())["Nodes"]["items"]
    again = decoder.decode(json.dumps({"Pod": {"n": 2}, "Nodes": {"items": sent}}).encode())
    assert again["Nodes"]["items"] is first and again["Pod"] == {"n": 2}
    sent[1] = node("b", "2", zone="new")
    changed = decoder.decode(json.dumps({"Pod": {}, "Nodes": {"items": sent}}).encode())["Nodes"]["items"]
    assert changed is not first and changed == sent


@pytest.mark.parametrize("payload", [
    {"Pod": {}, "Nodes": {"items": [node("a", "1")]}, "Extra": 1},  # a key Go does not write: kept
    {"Pod": {}, "Nodes": {"Items": [node("a", "1")], "kind": "NodeList"}},
    {"Pod": {}, "Nodes": {"items": [node("a", "1")], "other": [1]}},
])
def test_bodies_with_other_keys_keep_them(payload):
    assert decode_args(json.dumps(payload).encode(), {"a": node("a", "1")}.get) == payload


def test_the_same_body_again_is_not_decoded_again():
    decoder = ArgsDecoder({}.get)
    raw = json.dumps({"Pod": {"n": 1}, "NodeNames": ["a", "b"]}).encode()
    first = decoder.decode(raw)
    assert decoder.decode(bytes(raw)) is first  # prioritize after filter: equal bytes, the same objects
    other = decoder.decode(json.dumps({"Pod": {"n": 2}, "NodeNames": ["a", "b"]}).encode())
    assert other is not first and other["Pod"] == {"n": 2}
    with pytest.raises(BadJSON):
        decoder.decode(b"{")  # a bad body is an error however it follows a good one
    assert decoder.decode(raw) == first


def test_the_same_names_are_the_same_list():
    decoder = ArgsDecoder({}.get)
    first = decoder.decode(json.dumps({"Pod": {"n": 1}, "NodeNames": ["a", "b"]}).encode())["NodeNames"]
    again = decoder.decode(json.dumps({"Pod": {"n": 2}, "NodeNames": ["a", "b"]}).encode())["NodeNames"]
    assert isinstance(first, NodeNames) and again is first and first == ["a", "b"]
    other = decoder.decode(json.dumps({"Pod": {"n": 3}, "NodeNames": ["a", "c"]}).encode())["NodeNames"]
    assert other is not first and other == ["a", "c"]
    odd = decoder.decode(json.dumps({"Pod": {}, "NodeNames": ["a", 1]}).encode())["NodeNames"]
    assert odd == ["a", 1] and not isinstance(odd, NodeNames)  # as sent, for the extender to judge


def test_the_next_pod_with_the_same_nodes_decodes_only_the_pod():
    """Pod after pod with one node list (kube-scheduler's pattern): only the Pod is decoded and the node list
    is the last body's object; every body still decodes to what a fresh decoder makes of it."""
    decoder = ArgsDecoder({}.get)
    sent = [node("a", "1"), node("b", "1")]
    tail = b', "Nodes": ' + json.dumps({"items": sent}).encode() + b', "NodeNames": null}'
    first = decoder.decode(b'{"Pod": {"n": 1}' + tail)
    bodies = [
        b'{"Pod": {"n": 2, "s": "}, \\"Nodes\\": x"}' + tail,  # the next pod, with JSON-looking text inside
        b'{"Pod":{"n":3}' + tail,  # other spacing
        b'{"Pod": {"n": 4}, "Extra": 1' + tail,  # a key between: not the shape, decoded in full and kept
        b'{"Pod": {"n": 5}} ' + tail,  # not JSON once joined: an error, as from a fresh decoder
        b'{"Pod": [' + tail,
    ]
    for raw in bodies:
        try:
            want = ArgsDecoder({}.get).decode(raw)
        except BadJSON:
            with pytest.raises(BadJSON):
                decoder.decode(raw)
            continue
        got = decoder.decode(raw)
        assert got == want
        if "Extra" not in got:
            assert got["Nodes"]["items"] is first["Nodes"]["items"]
    # A second top-level Pod after the nodes decides the body (the last key wins): no shortcut for that shape.
    twice = b', "Nodes": {"items": []}, "Pod": {"n": 1}}'
    decoder.decode(b'{"Pod": {"n": 1}' + twice)
    assert decoder.decode(b'{"Pod": {"n": 2}' + twice) == ArgsDecoder({}.get).decode(b'{"Pod": {"n": 2}' + twice)

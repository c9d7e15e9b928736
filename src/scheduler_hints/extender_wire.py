"""Reading ExtenderArgs and writing replies without paying for what the extender already knows (msgspec).

With ``nodeCacheCapable: false`` kube-scheduler sends every candidate Node object on every call: 1–10 KiB each,
5–50 MB per request at 5,000 nodes. Building Python objects for all of it cost 50–70 ms per request
(``bench/extender_bench.py``), more than the whole latency target. So the request is split into its parts
without building them (``msgspec.Raw``; one pass for a body with the keys Go writes), each node's name and
``resourceVersion`` are read, and only a node the extender has not seen at that version is decoded in full; for
the others the extender's own copy stands in. The API server changes ``resourceVersion`` on every write, so
equal versions mean equal objects. Nodes returned by filter are written back as the bytes they came in as.
Keys are matched case-insensitively at the levels the extender protocol defines (Go's decoder does the same).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

__all__ = ["ArgsDecoder", "BadJSON", "NodeItems", "NodeNames", "as_sent", "encode"]


class BadJSON(ValueError):
    """The body is not JSON (or nests deeper than a decoder allows)."""


class NodeItems(list):
    """The Node objects of a request, with ``raw``: each one's JSON exactly as it arrived, so that a reply
    returning them (filter with ``nodeCacheCapable: false``) writes those bytes back instead of encoding 5 MB
    of objects again."""

    __slots__ = ("raw",)

    def __init__(self, nodes: list[Any], raw: list[msgspec.Raw]) -> None:
        super().__init__(nodes)
        self.raw = raw


class NodeNames(list):
    """A request's ``NodeNames`` (``nodeCacheCapable: true``), made by the decoder: the next pod with the same
    rest of the body gets the same object (:meth:`ArgsDecoder._same_nodes`), so that the extender can keep what
    it resolved the names to."""

    __slots__ = ()


class _Meta(msgspec.Struct):
    name: str = ""
    resourceVersion: str = ""


class _Ident(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


def _absent() -> msgspec.Raw:
    return msgspec.Raw()  # empty: the key was not there (a JSON null arrives as b"null")


class _NodeList(msgspec.Struct, forbid_unknown_fields=True):
    items: list[msgspec.Raw] | None = None
    metadata: msgspec.Raw = msgspec.field(default_factory=_absent)
    kind: msgspec.Raw = msgspec.field(default_factory=_absent)
    apiVersion: msgspec.Raw = msgspec.field(default_factory=_absent)


class _Args(msgspec.Struct, forbid_unknown_fields=True):
    """ExtenderArgs with exactly the keys Go writes (its struct has no json tags), split in one pass; any other
    key, or these in another case, fails validation and the body takes the general path."""

    Pod: msgspec.Raw = msgspec.field(default_factory=_absent)
    Nodes: _NodeList | None = None
    NodeNames: msgspec.Raw = msgspec.field(default_factory=_absent)


_any = msgspec.json.Decoder()
_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_items = msgspec.json.Decoder(list[msgspec.Raw])
_ident = msgspec.json.Decoder(_Ident)
_args = msgspec.json.Decoder(_Args)
_encoder = msgspec.json.Encoder()
_POD_START = re.compile(rb'\{\s*"Pod"\s*:\s*')

Known = Callable[[str], Mapping[str, Any] | None]


class ArgsDecoder:
    """Decodes request bodies for one extender: each Node object that ``known(name)`` holds at the same
    ``resourceVersion`` is replaced by that copy (not decoded); anything unexpected in shape is decoded as is,
    for the caller to judge. It also remembers the last node list: kube-scheduler sends the same candidates to
    filter and then, when all pass, to prioritize, and pod after pod while no node changes, so equal bytes reuse
    the objects decoded last time."""

    def __init__(self, known: Known) -> None:
        self.known = known
        self._last: tuple[bytes, NodeItems] | None = None
        self._last_body: tuple[bytes, Any] | None = None
        #: What followed the Pod in the last body decoded in full, and that body's other fields.
        self._after_pod: tuple[bytes, dict[str, Any]] | None = None

    def decode(self, data: bytes) -> Any:
        """The request body as Python objects. :class:`BadJSON` if ``data`` is not JSON. A body equal to the
        previous one (prioritize after filter for the same pod) is that one's objects again: callers read
        them and never change them."""
        last = self._last_body
        if last is not None and last[0] == data:
            return last[1]
        try:
            body = self._same_nodes(data)
            if body is None:
                body = self._decode(data)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
            raise BadJSON(str(exc)) from None
        self._last_body = (data, body)
        return body

    def _same_nodes(self, data: bytes) -> dict[str, Any] | None:
        """The next pod with the same nodes (or node names), as kube-scheduler sends pod after pod: ``{"Pod": …``
        then the bytes that followed the last body's Pod. Only the Pod is decoded (a 5 MB node list is not even
        split again); the rest is the last body's objects. None when the body is not of that shape."""
        after = self._after_pod
        if after is None or len(data) <= len(after[0]) or not data.endswith(after[0]):
            return None
        start = _POD_START.match(data)
        if start is None:
            return None
        try:  # a whole JSON value and nothing else, or this is not the shape we took it for
            pod = _any.decode(data[start.end():len(data) - len(after[0])])
        except msgspec.DecodeError:
            return None
        return {**after[1], "Pod": pod}

    def _remember_after_pod(self, data: bytes, pod: msgspec.Raw | None, body: Any) -> None:
        """Keep what followed ``pod`` in ``data`` for :meth:`_same_nodes`, when ``pod`` is the first key's value."""
        start = _POD_START.match(data)
        raw = bytes(pod) if pod else b""
        if start is None or not raw or not data.startswith(raw, start.end()) or not isinstance(body, dict):
            return
        after = data[start.end() + len(raw):]
        # A second top-level Pod (in any case: Go matches keys so) would decide the body, which the shortcut
        # would miss; any "pod" key in the rest, at whatever depth, rules the shortcut out.
        if b'"pod"' not in after.lower():
            self._after_pod = (after, {k: v for k, v in body.items() if k != "Pod"})

    def _decode(self, data: bytes) -> Any:
        try:
            args = _args.decode(data)
        except msgspec.ValidationError:  # other keys or shapes: the general path keeps them as sent
            return self._decode_general(data)
        if args.Nodes is None or args.Nodes.items is None:
            general = self._decode_general(data)
            self._remember_after_pod(data, args.Pod, general)
            return general
        nodes: dict[str, Any] = {"items": self._items(args.Nodes.items)}
        for key in ("metadata", "kind", "apiVersion"):
            value = getattr(args.Nodes, key)
            if value:
                nodes[key] = _any.decode(value)
        body: dict[str, Any] = {"Nodes": nodes}
        if args.Pod:
            body["Pod"] = _any.decode(args.Pod)
        if args.NodeNames:
            body["NodeNames"] = self._names(args.NodeNames)
        if args.Pod:
            self._remember_after_pod(data, args.Pod, body)
        return body

    def _decode_general(self, data: bytes) -> Any:
        """Any JSON: keys matched in any case, as Go's decoder does; node lists as in the typed path."""
        try:
            fields = _fields.decode(data)
        except msgspec.ValidationError:  # valid JSON, but not an object
            return _any.decode(data)
        return {key: self._node_list(raw) if key.lower() == "nodes" else
                self._names(raw) if key.lower() == "nodenames" else _any.decode(raw) for key, raw in fields.items()}

    @staticmethod
    def _names(raw: msgspec.Raw) -> Any:
        """A NodeNames list as :class:`NodeNames` (anything else as sent, for the caller to judge)."""
        value = _any.decode(raw)
        return NodeNames(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value

    def _node_list(self, raw: msgspec.Raw) -> Any:
        try:
            fields = _fields.decode(raw)
        except msgspec.ValidationError:  # null, or not a NodeList
            return _any.decode(raw)
        out: dict[str, Any] = {}
        for key, value in fields.items():
            try:
                out[key] = self._items(_items.decode(value)) if key.lower() == "items" else _any.decode(value)
            except msgspec.ValidationError:  # items that are not a list: as sent, for the caller to judge
                out[key] = _any.decode(value)
        return out

    def _items(self, raws: list[msgspec.Raw]) -> NodeItems:
        whole = b"\0".join(raws)  # what identifies the list: its nodes' bytes, in order
        last = self._last
        if last is not None and last[0] == whole:
            return last[1]
        nodes = NodeItems([_known_or_decoded(raw, self.known) for raw in raws], raws)
        self._last = (whole, nodes)
        return nodes


def as_sent(nodes: list[Any]) -> list[Any]:
    """``nodes`` for a reply: the bytes they arrived as when they are a request's whole :class:`NodeItems`."""
    return nodes.raw if isinstance(nodes, NodeItems) else list(nodes)


def _known_or_decoded(raw: msgspec.Raw, known: Known) -> Any:
    try:
        meta = _ident.decode(raw).metadata
    except msgspec.ValidationError:  # not a Node-shaped object: as sent, for the caller to judge
        return _any.decode(raw)
    node = _known_at(meta, known)
    return _any.decode(raw) if node is None else node


def _known_at(meta: _Meta, known: Known) -> Mapping[str, Any] | None:
    """The extender's copy of this node if it has it at this ``resourceVersion``."""
    if not (meta.name and meta.resourceVersion):
        return None
    node = known(meta.name)
    if node is None or (node.get("metadata") or {}).get("resourceVersion") != meta.resourceVersion:
        return None
    return node


def encode(obj: Any) -> bytes:
    """``obj`` as JSON bytes (several times faster than :func:`json.dumps` for 5,000 Node objects)."""
    return _encoder.encode(obj)

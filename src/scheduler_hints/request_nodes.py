"""A request's nodes as the extender scores them: Node objects resolved against the node cache, and their
NodeStates net of the GPUs the extender holds for pods, kept from one request to the next.

kube-scheduler asks pod after pod about the same candidates. The decoder hands the same list object for the
same bytes (:class:`~scheduler_hints.extender_wire.NodeItems`, :class:`~scheduler_hints.extender_wire.NodeNames`), so what a list
resolved to is kept for that object while the node cache does not change, and only the nodes it updated since
are looked up again. Lists handed out are never changed in place (a change makes a new list), and a state net of
held GPUs is the same object while its base and the amount are: callers may keep anything per list or per state
object (:func:`~scheduler_hints.memo.replaced`). The verbs' replies for a list are kept here too
(:meth:`RequestNodes.reply_for`): the view is what they are keyed on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from scheduler_hints.extender_wire import NodeItems, NodeNames
from scheduler_hints.memo import room
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.scoring import NodeState

__all__ = ["RequestNodes"]


@dataclass
class _Resolved:
    """A request's node list (``source``: the decoder's object) resolved as of ``node_cache.updates ==
    updates``: the Node objects, their base NodeStates once asked for, and each name's positions once needed."""

    source: Any
    updates: int
    items: list[Mapping[str, Any]]
    base: list[NodeState] | None = None
    position: dict[str, list[int]] | None = None


class RequestNodes:
    """Resolves request node lists against ``node_cache`` and nets their states of held GPUs."""

    def __init__(self, node_cache: NodeCache) -> None:
        self.node_cache = node_cache
        self._last: _Resolved | None = None
        self._net: dict[str, tuple[NodeState, int, NodeState]] = {}
        self._cluster_position: tuple[list[NodeState], dict[str, int]] | None = None
        self._matching: tuple[list[NodeState], tuple[bool | None, tuple], list[NodeState]] | None = None
        self._replies: dict[str, tuple[Any, Any]] = {}  # verb → (the list it answered, what it answered)

    # -- replies kept per list ------------------------------------------------------------------------------------
    def reply_for(self, verb: str, source: Any) -> Any | None:
        """What ``verb`` kept for the list object ``source`` (None: nothing, or for another list)."""
        last = self._replies.get(verb)
        return last[1] if last is not None and last[0] is source else None

    def keep_reply(self, verb: str, source: Any, reply: Any) -> None:
        self._replies[verb] = (source, reply)

    def full(self, items: list) -> list[Mapping[str, Any]]:
        """``Nodes.items`` (``nodeCacheCapable: false``): the Node objects in it, each put in the node cache
        unless the cache holds that very object (the decoder's copy of a node known at this version)."""
        if self.resolved(items) is not None:
            return items
        if not (isinstance(items, NodeItems) and all(isinstance(n, Mapping) for n in items)):
            items = [n for n in items if isinstance(n, Mapping)]
        cached = self.node_cache.nodes
        for n in items:
            if cached.get(str((n.get("metadata") or {}).get("name"))) is not n:  # not known at this version
                self.node_cache.update(n)
        if isinstance(items, NodeItems):  # the decoder's memo: the same object while the bytes match
            self._last = _Resolved(items, self.node_cache.updates, items)
        return items

    def named(self, names: list) -> list[Mapping[str, Any]]:
        """The Node objects for a NodeNames list (``nodeCacheCapable: true``; unknown names get a bare node).
        The lookup is kept for a :class:`NodeNames` object: nodes the cache updated since (a watch delivers some
        every few milliseconds at 5,000 nodes) are looked up again, not all."""
        last = self._last
        if last is not None and last.source is names:
            changed = self.node_cache.changed_since(last.updates)
            if changed is not None and len(changed) <= 256:
                if changed:
                    self._refresh(last, changed)
                return last.items
        items = [self._by_name(n) for n in names if isinstance(n, str)]
        if isinstance(names, NodeNames):
            self._last = _Resolved(names, self.node_cache.updates, items)
        return items

    def resolved(self, items: list) -> _Resolved | None:
        """What ``items`` (a list this returned) resolved to, if the node cache has not changed since; while it
        holds, the list's nodes are the same in the same order (callers key memos on it)."""
        last = self._last
        return last if last is not None and last.items is items and last.updates == self.node_cache.updates else None

    def states(self, items: list, held: Mapping[str, int]) -> list[NodeState]:
        """NodeStates of ``items`` with ``gpu_free`` net of ``held`` GPUs per node name. With nothing held this
        is the list's base states themselves, the same list while :meth:`resolved` holds."""
        last = self.resolved(items)
        base = last.base if last is not None else None
        if base is None:
            base = [self.node_cache.base_state(node) for node in items]
            if last is not None:
                last.base = base
        if not held:
            return base
        if last is None:
            return [self.net(b, held) for b in base]
        out = list(base)  # only the nodes holding GPUs differ from their base states
        positions = self._positions(last)
        for name in held:
            for i in positions.get(name, ()):
                out[i] = self.net(base[i], held)
        return out

    def cluster(self, held: Mapping[str, int]) -> list[NodeState]:
        """Every node's state (:meth:`NodeCache.cluster`) net of ``held``: the base list itself when nothing is
        held, otherwise a copy with only the holding nodes replaced."""
        base = self.node_cache.cluster()[0]
        if not held:
            return base
        memo = self._cluster_position
        if memo is None or memo[0] is not base:
            memo = self._cluster_position = (base, {n.name: i for i, n in enumerate(base)})
        out = list(base)
        for name in held:
            i = memo[1].get(name)
            if i is not None:
                out[i] = self.net(base[i], held)
        return out

    def cluster_matching(self, held: Mapping[str, int], style: bool | None,
                         selector: tuple[tuple[str, str], ...]) -> list[NodeState]:
        """:meth:`cluster` less the nodes a pod cannot use: those its ``selector`` (label pairs) does not match,
        and the GPU nodes of the other ``style`` (True: nodes a DRA driver publishes only; False: the others
        only; None: either). The same list while the cluster list and the pod's terms are."""
        cluster = self.cluster(held)
        if not selector and style is None:
            return cluster
        memo = self._matching
        if memo is not None and memo[0] is cluster and memo[1] == (style, selector):
            return memo[2]
        mine = [n for n in cluster
                if (style is None or n.gpus_by_dra == style or not n.gpu_allocatable)
                and all(n.labels.get(k) == v for k, v in selector)]
        self._matching = (cluster, (style, selector), mine)
        return mine

    def net(self, base: NodeState, held: Mapping[str, int]) -> NodeState:
        """``base`` less the GPUs ``held`` on it: the same object for the same base and amount."""
        amount = held.get(base.name)
        if not amount:
            return base
        hit = self._net.get(base.name)
        if hit is None or hit[0] is not base or hit[1] != amount:
            hit = room(self._net, 100_000)[base.name] = (
                base, amount, replace(base, gpu_free=max(0, base.gpu_allocatable - amount)))
        return hit[2]

    def _by_name(self, name: str) -> Mapping[str, Any]:
        node = self.node_cache.nodes.get(name)
        if node is None:
            node = {"metadata": {"name": name}}
            self.node_cache.update(node)
        return node

    def _refresh(self, last: _Resolved, changed: list[str]) -> None:
        """Look the ``changed`` nodes of ``last`` up again, into new lists (callers keep what they were handed)."""
        positions = self._positions(last)
        items, base = list(last.items), None if last.base is None else list(last.base)
        for name in set(changed):
            for i in positions.get(name, ()):
                node = items[i] = self._by_name(name)
                if base is not None:
                    base[i] = self.node_cache.base_state(node)
        last.items, last.base, last.updates = items, base, self.node_cache.updates

    @staticmethod
    def _positions(last: _Resolved) -> dict[str, list[int]]:
        """Where each name is in ``last``'s list (the name as its NodeState has it)."""
        if last.position is None:
            last.position = {}
            for i, n in enumerate(last.items):
                last.position.setdefault(str((n.get("metadata") or {}).get("name", "")), []).append(i)
        return last.position

"""The extender's view of the cluster's nodes: Node objects by name (fed by a watch, or by requests carrying
full Node objects), each node's parsed cache view, and the cluster-wide view scoring uses."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from scheduler_hints.dra import DraInventory
from scheduler_hints.labels import DATASET_PREFIX, FREE_LABEL, read_node
from scheduler_hints.scoring import NodeState, domain_index, group_fractions
from scheduler_hints.topology import DomainIndex

__all__ = ["OWN_LABEL_PREFIXES", "NodeCache"]

#: Labels the node agents rewrite as caches change; they do not move a node between topology domains.
OWN_LABEL_PREFIXES = (DATASET_PREFIX + "/", FREE_LABEL)


class NodeCache:
    """Node objects by name, for ``nodeCacheCapable: true`` (fed by a watch) and for cluster-wide views, with
    each node's parsed cache view kept until the node's labels or annotations change (parsing 5,000 nodes'
    annotations on every request would dominate the latency)."""

    def __init__(self, refresh_interval: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 dra: DraInventory | None = None) -> None:
        self.nodes: dict[str, Mapping[str, Any]] = {}
        #: GPUs a DRA driver publishes (ResourceSlices): a node it publishes counts those instead of its
        #: ``nvidia.com/gpu`` allocatable, and its devices' topology attributes join its labels.
        self.dra = dra
        self._parsed: dict[str, tuple[Any, NodeState]] = {}
        #: How often the cluster-wide view (and every score memoised on it) follows cache-label changes: 5,000
        #: node agents publishing every 30 s change some node's labels every few milliseconds, and rebuilding
        #: the view and re-scoring every node for each would put that cost into nearly every request.
        self.refresh_interval = refresh_interval
        self._clock = clock
        #: Bumped by every update and removal, even of a node to an equal copy: a node list checked against the
        #: cache at one value of it needs no second check while it holds.
        self.updates = 0
        self._log: deque[tuple[int, str]] = deque(maxlen=1024)  # (updates after it, name) of recent updates
        self._changes = 0  # bumped whenever the set of nodes or any node's parsed state changes
        self._layout_changes = 0  # … only when nodes come or go, or their topology labels or GPUs change
        self._published = (0, -float("inf"), 0)  # (changes, when, layout changes)
        self._layout: dict[str, tuple] = {}
        self._cluster: tuple[int, list[NodeState], dict, int] | None = None
        self._domains: tuple[int, tuple[str, ...], DomainIndex] | None = None

    @property
    def generation(self) -> int:
        """Identifies the cluster-wide view: follows cache-label changes at most once per ``refresh_interval``,
        nodes coming or going and changes of their topology labels or GPUs at once."""
        changes, at, layout = self._published
        if changes != self._changes and (layout != self._layout_changes or self._clock() - at >= self.refresh_interval):
            self._published = (self._changes, self._clock(), self._layout_changes)
        return self._published[0]

    def update(self, node: Mapping[str, Any]) -> None:
        name = (node.get("metadata") or {}).get("name")
        if name:
            self.updates += 1
            self._log.append((self.updates, name))
            if name not in self.nodes:
                self._changes += 1
            self.nodes[name] = node
            self._parse(node)  # parse now (counts a change if it changed)

    def remove(self, name: str) -> None:
        self.updates += 1
        self._log.append((self.updates, name))
        if self.nodes.pop(name, None) is not None:
            self._changes += 1
            self._layout_changes += 1
        self._parsed.pop(name, None)
        self._layout.pop(name, None)

    def changed_since(self, updates: int) -> list[str] | None:
        """Names of the nodes updated or removed since :attr:`updates` was ``updates`` (None: too many to say)."""
        if updates == self.updates:
            return []
        log = self._log
        if not log or log[0][0] > updates + 1:
            return None
        return [name for at, name in log if at > updates]

    def dra_changed(self) -> None:
        """Re-read the nodes whose DRA devices changed (the ResourceSlice watch calls this)."""
        if self.dra is None:
            return
        for name in self.dra.changed_nodes:
            node = self.nodes.get(name)
            if node is not None:
                self._parse(node)
        self.dra.changed_nodes.clear()

    def cluster(self) -> tuple[list[NodeState], dict]:
        """Every node's base state and the per-group best holders, as of :attr:`generation`."""
        generation = self.generation
        cluster = self._cluster
        if cluster is None or cluster[0] != generation:
            states = [self._parsed[name][1] for name in self.nodes]
            cluster = self._cluster = (generation, states, group_fractions(states), self._layout_changes)
        return cluster[1], cluster[2]

    def domains(self, levels: tuple[str, ...]) -> DomainIndex:
        """The :func:`~scheduler_hints.scoring.domain_index` of :meth:`cluster` for ``levels``, rebuilt only
        when the nodes or their topology labels changed."""
        states = self.cluster()[0]
        assert self._cluster is not None
        layout = self._cluster[3]
        domains = self._domains
        if domains is None or domains[:2] != (layout, levels):
            domains = self._domains = (layout, levels, domain_index(states, levels))
        return domains[2]

    def base_state(self, node: Mapping[str, Any]) -> NodeState:
        """The node's NodeState with ``gpu_free`` = allocatable (callers subtract usage)."""
        meta = node.get("metadata") or {}
        name = str(meta.get("name", ""))
        if self.nodes.get(name) is node and name in self._parsed:  # the cached object itself: parsed on update
            return self._parsed[name][1]
        return self._parse(node)

    def _parse(self, node: Mapping[str, Any]) -> NodeState:
        meta = node.get("metadata") or {}
        name = str(meta.get("name", ""))
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        status = node.get("status") or {}
        alloc_raw = (status.get("allocatable") or {}).get("nvidia.com/gpu", 0) if isinstance(status, Mapping) else 0
        version = (meta.get("resourceVersion") or (labels, annotations, alloc_raw),
                   self.dra.node_version(name) if self.dra is not None else 0)
        hit = self._parsed.get(name)
        if hit is not None and hit[0] == version:
            return hit[1]
        dra_gpus = self.dra.node_gpus(name) if self.dra is not None else None
        if dra_gpus is not None:
            alloc = dra_gpus
            topology = self.dra.node_topology(name) if self.dra is not None else {}
            if any(k not in labels for k in topology):
                labels = {**topology, **labels}  # (a label on the Node wins over its devices' attribute)
        else:
            try:
                alloc = max(0, int(str(alloc_raw)))
            except ValueError:
                alloc = 0
        state = NodeState(name, read_node(name, labels, annotations), labels, alloc, alloc, dra_gpus is not None)
        self._parsed[name] = (version, state)
        self._changes += 1
        if self.nodes.get(name) is node:  # a cached node: did its place in the topology change?
            layout = (alloc, *sorted((k, v) for k, v in labels.items() if not k.startswith(OWN_LABEL_PREFIXES)))
            if self._layout.get(name) != layout:
                self._layout[name] = layout
                self._layout_changes += 1
        return state

"""A cache group's members, as this node sees them.

Members come from a static list (``--peers``, for one host and tests) or from the Kubernetes API: the
EndpointSlices of the group's headless Service, listed once and then watched (resumed from the last resource
version, listed again when the server says 410 Gone), the way kube-proxy follows Services. Only ready endpoints
count. No consensus, no gossip, no per-agent Lease: the API server already knows which node pods are up, and a
watch costs it one stream per agent.

The watches are :class:`~cachefs.kube.Reflector` loops, the same the scheduler extender runs.

A member that disappears stays placed as *draining* for a grace period (``cluster.drain_grace``, 10 minutes): a
node pod that restarts comes back to the keys it owned, instead of every key moving twice. Readers ask draining
members last (their requests fail fast, and the next candidate answers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections.abc import Callable, Mapping

from cachefs.cluster.members import Member, parse_peers
from cachefs.cluster.placement import Placement, Weighted
from cachefs.kube import KubeClient, Reflector

__all__ = ["EndpointSliceWatch", "Member", "MemberTable", "parse_peers"]

log = logging.getLogger(__name__)


class MemberTable:
    """The group's members and their placement; :meth:`update` with who is present now."""

    def __init__(self, self_name: str, *, grace: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.self_name, self.grace, self.clock = self_name, grace, clock
        self._members: dict[str, Member] = {}
        self._draining: dict[str, float] = {}  # name → since when
        self.placement = Placement([])
        #: Bumped at every change (what the peer tier keys its per-member state by).
        self.generation = 0

    @property
    def members(self) -> dict[str, Member]:
        return dict(self._members)

    def active(self, name: str) -> bool:
        return name in self._members and name not in self._draining

    def member(self, name: str) -> Member | None:
        return self._members.get(name)

    def draining(self) -> list[str]:
        return sorted(self._draining)

    def update(self, present: Mapping[str, Member]) -> bool:
        """Who is present now: new members join, ones that changed address or weight are replaced, absent ones
        start draining, ones drained past the grace period leave. Returns whether placement changed."""
        if self._first_view(present, ()):
            return True
        now, placement, changed = self.clock(), self.placement, False
        for name, m in present.items():
            old = self._members.get(name)
            self._draining.pop(name, None)
            if old == m:
                continue
            if old is not None and old.weight == m.weight:  # a new address only: placement is unchanged
                self._members[name] = m
                changed = True
                continue
            placement = placement.joined(Weighted(name, m.weight))
            self._members[name] = m
            changed = True
        for name in list(self._members):
            if name not in present and name not in self._draining:
                self._draining[name] = now
                log.info("cache group: %s left; draining for %.0f s", name, self.grace)
                changed = True
        for name, since in list(self._draining.items()):
            if now - since >= self.grace:
                placement = placement.left(name)
                del self._members[name], self._draining[name]
                log.info("cache group: %s drained; its keys move to the next members", name)
                changed = True
        if changed:
            self.placement = placement
            self.generation += 1
        return changed

    def _first_view(self, members: Mapping[str, Member], draining, made=None) -> bool:
        """An empty table's first members: one table made at once (a join is incremental, and N of them cost N
        passes over the slots: ~6 ms each at 5,000 members, bench/placement_bench.py, half a minute for all), or
        taken as ``made`` hands it over."""
        if self._members or not members:
            return False
        now = self.clock()
        self._members = dict(members)
        self._draining = {n: now for n in draining if n in members}
        weighted = [Weighted(n, m.weight) for n, m in members.items()]
        self.placement = (made(weighted) if made is not None else None) or Placement(weighted)
        self.generation += 1
        return True

    def replace(self, members: Mapping[str, Member], draining: frozenset[str] | set[str], *,
                made: Callable[[list[Weighted]], Placement | None] | None = None) -> bool:
        """Take the members and draining set another process decided (the agent's members file): placement
        follows, incrementally; ``made(members)``, on the first view, may hand over a table the agent made for
        them. Returns whether anything changed."""
        if self._first_view(members, draining, made):
            return True
        now, placement, changed = self.clock(), self.placement, False
        for name in [n for n in self._members if n not in members]:
            placement = placement.left(name)
            del self._members[name]
            changed = True
        for name, m in members.items():
            old = self._members.get(name)
            if old != m:
                if old is None or old.weight != m.weight:
                    placement = placement.joined(Weighted(name, m.weight))
                self._members[name] = m
                changed = True
        want = {n: self._draining.get(n, now) for n in draining if n in members}
        if want.keys() != self._draining.keys():
            changed = True
        self._draining = want
        if changed:
            self.placement = placement
            self.generation += 1
        return changed

    def expire(self) -> bool:
        """Drop members drained past the grace period (call now and then)."""
        return self.update({n: m for n, m in self._members.items() if n not in self._draining}) \
            if any(self.clock() - s >= self.grace for s in self._draining.values()) else False


GROUP_LABEL = "cachefs.io/cache-group"
#: Node annotations the label publisher (scheduler_hints.labels, docs/LABELS.md) writes: the node's cache
#: (``capacityBytes``: its placement weight) and, per dataset, what the node holds (``cachedBytes``, ``totalBytes``).
CACHE_ANNOTATION = "cachefs.io/cache"
DATASET_ANNOTATION_PREFIX = "ds.cachefs.io/"
_GIB = 1 << 30


def _node_cache(annotations: Mapping[str, str]) -> tuple[int, dict[str, tuple[int, int]]]:
    """(capacity in bytes, 0 if unknown; {dataset id: (owned, total)}) from a Node's annotations, owned being the
    cached bytes less guest copies of what other members own; what does not parse is left out."""
    try:
        capacity = max(0, int(json.loads(annotations.get(CACHE_ANNOTATION, "{}")).get("capacityBytes", 0)))
    except (ValueError, TypeError, AttributeError):
        capacity = 0
    datasets = {}
    for key, value in annotations.items():
        if key.startswith(DATASET_ANNOTATION_PREFIX):
            try:
                d = json.loads(value)
                owned = int(d["cachedBytes"]) - int(d.get("guestBytes") or 0)
                datasets[key[len(DATASET_ANNOTATION_PREFIX):]] = (max(0, owned), max(0, int(d["totalBytes"])))
            except (ValueError, KeyError, TypeError):
                continue
    return capacity, datasets


class EndpointSliceWatch:
    """Keeps a :class:`MemberTable` in step with the ready endpoints of one headless Service (list + watch).

    With ``group``, only endpoints on nodes labelled ``cachefs.io/cache-group=<group>`` are members: one Service
    over every node pod of the DaemonSet, and the group each node belongs to read from its Node's labels (a
    second watch, of this group's nodes only). That watch also brings what each member's label publisher
    annotated: its cache capacity, which weighs it in placement (in GiB; a member not annotated yet weighs the
    group's median, so in a group of equal disks nothing moves when its annotation arrives), and what it holds of
    each dataset (:meth:`group_datasets`)."""

    #: Name of the Service port members serve the peer protocol on.
    PORT_NAME = "peer"

    def __init__(self, client: KubeClient, namespace: str, service: str, table: MemberTable,
                 weight: Callable[[str], float] = lambda name: 1.0, *, group: str = "") -> None:
        self.client, self.namespace, self.service, self.table = client, namespace, service, table
        self.weight, self.group = weight, group
        self._slices: dict[str, dict[str, Member]] = {}
        self._group_nodes: set[str] = set()
        self._capacity: dict[str, int] = {}  # group node → cache capacity (bytes), from its annotation
        self._datasets: dict[str, dict[str, tuple[int, int]]] = {}  # group node → dataset id → (cached, total)
        self._slices_listed, self._nodes_listed = False, not group
        self.synced = asyncio.Event()

    @property
    def path(self) -> str:
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def _members_of(self, eps: Mapping) -> dict[str, Member]:
        port = next((p.get("port") for p in eps.get("ports") or [] if p.get("name") == self.PORT_NAME), None)
        out: dict[str, Member] = {}
        if port is None:
            return out
        for ep in eps.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            name = ep.get("nodeName") or (ep.get("targetRef") or {}).get("name")
            addresses = ep.get("addresses") or []
            if not name or not addresses:
                continue
            host = addresses[0]
            host = f"[{host}]" if ":" in host else host
            out[name] = Member(name, f"{host}:{port}", self.weight(name))
        return out

    def _weighed(self, members: dict[str, Member]) -> dict[str, Member]:
        if not self._capacity:
            return members
        known = {n: max(1, c // _GIB) for n, c in self._capacity.items() if c > 0}
        if not known:
            return members
        default = float(statistics.median(known.values()))
        return {n: Member(n, m.address, float(known.get(n, default))) for n, m in members.items()}

    def group_datasets(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Per member (active ones), what its annotations say it owns: {node: {dataset id: (owned, total)}}."""
        return {n: dict(d) for n, d in self._datasets.items() if self.table.active(n)}

    def _apply(self) -> None:
        if not (self._slices_listed and self._nodes_listed):
            return
        present: dict[str, Member] = {}
        for members in self._slices.values():
            present.update(members)
        if self.group:
            present = self._weighed({n: m for n, m in present.items() if n in self._group_nodes})
        self.table.update(present)
        self.synced.set()

    def _slice_event(self, kind: str, obj: Mapping) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        if kind == "SYNC":
            self._slices_listed = True
        elif kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = self._members_of(obj)
        self._apply()

    def _node_event(self, kind: str, obj: Mapping) -> None:
        meta = obj.get("metadata") or {}
        name, labels = meta.get("name", ""), meta.get("labels") or {}
        before = name in self._group_nodes
        weighed_before = self._capacity.get(name, 0)
        if kind == "SYNC":
            self._nodes_listed = True
        elif kind == "DELETED" or labels.get(GROUP_LABEL) != self.group:
            self._group_nodes.discard(name)
            self._capacity.pop(name, None)
            self._datasets.pop(name, None)
        else:
            self._group_nodes.add(name)
            self._capacity[name], self._datasets[name] = _node_cache(meta.get("annotations") or {})
        # (a relist repeats every node; dataset figures change placement in nothing)
        if kind == "SYNC" or before != (name in self._group_nodes) or weighed_before != self._capacity.get(name, 0):
            self._apply()

    async def run(self) -> None:
        """Follow the Service's slices (and the group's nodes) until cancelled."""
        watches = [Reflector(self.client, self.path, self._slice_event,
                             params={"labelSelector": f"kubernetes.io/service-name={self.service}"}).run()]
        if self.group:
            watches.append(Reflector(self.client, "/api/v1/nodes", self._node_event,
                                     params={"labelSelector": f"{GROUP_LABEL}={self.group}"}).run())
        await asyncio.gather(*watches)

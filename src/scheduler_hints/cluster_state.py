"""What the extender knows of the cluster: nodes (the node cache), GPUs handed out by DRA, pods it saw, bound and
waiting for GPUs, gangs and their sizes. The watches feed it; the verbs read it (:mod:`.extender`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler_hints.dra import DraInventory
from scheduler_hints.gang import GangManager
from scheduler_hints.memo import room
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.pods import VolumeIndex, pod_datasets, pod_gpus, pod_key
from scheduler_hints.scoring import PodNeeds

__all__ = ["ClusterState"]


@dataclass
class ClusterState:
    node_cache: NodeCache = field(default_factory=NodeCache)
    gangs: GangManager = field(default_factory=GangManager)
    #: Datasets of pods' volumes (PVC → dataset), when wired.
    volumes: VolumeIndex | None = None
    #: GPUs by Dynamic Resource Allocation (ResourceSlice and ResourceClaim watches when wired): the node
    #: cache's counts, pods' demand through claims, and devices allocated to claims as held GPUs.
    dra: DraInventory | None = None
    #: PodGroup minMember by ``namespace/name`` (from a PodGroup watch when wired).
    min_members: dict[str, int] = field(default_factory=dict)
    #: Pods the extender bound: pod key -> (node, GPUs). A pod watch calls :meth:`pod_gone` on deletion.
    bound_pods: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: Pods not yet on a node that request GPUs: pod key -> GPUs (from the pod watch). While those that need a
    #: whole node outnumber the whole free nodes, smaller pods pack harder (``Weights.packing_when_short``).
    pending_pods: dict[str, int] = field(default_factory=dict)
    _pods: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Pods bound to a DRA node whose claims the claim watch has not yet shown allocated: pod key -> (node, pod).
    #: kube-scheduler writes the allocation before it asks for the bind, but the watch may say so later; until it
    #: does, the pod's GPUs are held here (a gang admitted in that gap went across cliques).
    _unseen_allocations: dict[str, tuple[str, Mapping[str, Any]]] = field(default_factory=dict)
    _totals_memo: dict[tuple, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dra is not None:
            self.use_dra(self.dra)

    def use_dra(self, dra: DraInventory) -> DraInventory:
        """Count GPUs handed out by DRA (``dra``, fed by its watches), in the node cache too."""
        self.dra = self.node_cache.dra = dra
        return dra

    # -- pods the verbs saw -------------------------------------------------------------------------------------
    def saw(self, pod: Mapping[str, Any]) -> None:
        """A pod a filter or prioritize asked about (bounded: bind looks it up shortly after)."""
        room(self._pods, 100_000)[pod_key(pod)] = pod

    def pod(self, uid: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod seen of that uid (or, without one, of that name), if it is the one named."""
        pod = self._pods.get(uid) or self._pods.get(f"{namespace}/{name}")
        meta = (pod or {}).get("metadata") or {}
        if pod is None or (meta.get("name"), meta.get("namespace", "default")) != (name, namespace):
            return None
        return pod

    def bound(self, key: str, node: str, pod: Mapping[str, Any]) -> None:
        self.bound_pods[key] = (node, pod_gpus(pod))  # (its claims' devices count where they are allocated)
        self.pending_pods.pop(key, None)
        if self._claims_unseen(key, node, pod):
            self._unseen_allocations[key] = (node, pod)

    # -- what the watches say -------------------------------------------------------------------------------------
    def pod_pending(self, key: str, gpus: int) -> None:
        """The pod watch saw a pod that requests GPUs and is on no node yet."""
        room(self.pending_pods, 1_000_000)[key] = gpus

    def pod_gone(self, key: str) -> None:
        """A pod was deleted or finished: its GPUs are free again."""
        self.bound_pods.pop(key, None)
        self.pending_pods.pop(key, None)
        self._pods.pop(key, None)
        self._unseen_allocations.pop(key, None)

    # -- what the verbs ask ---------------------------------------------------------------------------------------
    def gpus_of(self, pod: Mapping[str, Any]) -> int:
        """GPUs the pod asks for: ``nvidia.com/gpu`` in its containers, and devices of GPU classes in its claims
        that are not allocated yet."""
        gpus = pod_gpus(pod)
        if self.dra is not None:
            gpus += self.dra.pod_gpus(pod, pod_key(pod))
        return gpus

    def _claims_unseen(self, key: str, node: str, pod: Mapping[str, Any] | None) -> int | None:
        """On a DRA node, the GPUs of the pod's claims not yet seen allocated (0 once they all are); None on a
        node whose GPUs are the extended resource, or for a pod not known here."""
        if self.dra is None or pod is None or self.dra.node_gpus(node) is None:
            return None
        return self.dra.pod_gpus(pod, key)

    def held(self) -> dict[str, int]:
        """GPUs held per node: by bound pods' extended resources, by devices allocated to resource claims (and by
        bound pods' claims until the watch shows them allocated), and by gang members placed but not yet bound."""
        held: dict[str, int] = dict(self.dra.allocated_by_node()) if self.dra is not None else {}
        for n, g in self.bound_pods.values():
            if self.dra is None or self.dra.node_gpus(n) is None:  # (a DRA node's GPUs are held by claims)
                held[n] = held.get(n, 0) + g
        for key, (n, pod) in list(self._unseen_allocations.items()):
            unseen = self._claims_unseen(key, n, pod)
            if unseen:
                held[n] = held.get(n, 0) + unseen
            else:  # seen allocated: counted by the claims from now on
                del self._unseen_allocations[key]
        for key, n, g in self.gangs.reservations():
            unseen = self._claims_unseen(key, n, self._pods.get(key))
            held[n] = held.get(n, 0) + (g if unseen is None else unseen)
        return held

    def needs(self, pod: Mapping[str, Any]) -> PodNeeds:
        """The pod's datasets with their total bytes (as the nodes holding them report it) and its GPUs."""
        ids = tuple(sorted(pod_datasets(pod, self.volumes)))
        key = (ids, self.node_cache.generation)
        totals = self._totals_memo.get(key)
        if totals is None:
            states = self.node_cache.cluster()[0]
            totals = {}
            for ds in ids:
                known = [n.cache.cached_bytes.get(ds, 0) / n.cache.fractions[ds]
                         for n in states if n.cache.fractions.get(ds) and n.cache.cached_bytes.get(ds)]
                totals[ds] = int(max(known, default=0))
            room(self._totals_memo, 64)[key] = totals
        return PodNeeds(totals, self.gpus_of(pod))

    def gpu_style(self, pod: Mapping[str, Any]) -> bool | None:
        """On a cluster with both kinds of GPU nodes: whether the pod runs only on nodes a DRA driver publishes
        (True: it asks through resource claims only) or only on the others (False); None: either."""
        if self.dra is None or not self.dra.publishes_nodes():
            return None
        by_ext, by_dra = pod_gpus(pod), self.dra.pod_gpus(pod, pod_key(pod))
        if bool(by_ext) != bool(by_dra) and not (by_ext and self.dra.maps_extended_resource()):
            return bool(by_dra)
        return None

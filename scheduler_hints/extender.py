"""The kube-scheduler extender: ``POST /filter``, ``/prioritize`` and ``/bind`` (aiohttp; thin glue).

Each verb is an adapter: it reads the request, asks the policy core — :mod:`.admission` (gangs all or nothing,
delay scheduling for locality) for ``/filter``, :mod:`.priorities` (scores over :mod:`.scoring`) for
``/prioritize``, the gang manager for ``/bind`` — and shapes the reply.

Wire format as ``k8s.io/kube-scheduler/extender/v1`` emits it: the structs have no JSON tags, so keys are Go
field names (``Pod``, ``Nodes``, ``NodeNames``, ``FailedNodes``, ``FailedAndUnresolvableNodes``, ``Error``,
``Host``, ``Score``, ``PodName``, ``PodNamespace``, ``PodUID``, ``Node``). We emit exactly those and accept
any case, as Go's decoder does. Scores are 0–10 (``MaxExtenderPriority``).

Both ``nodeCacheCapable`` modes work: with ``false`` the request carries full Node objects (their labels,
annotations and allocatable GPUs are read from it); with ``true`` only names arrive and the node details
come from the extender's own node cache (:class:`NodeCache`, fed by a watch or, in tests, by hand).

Every malformed input gets a 4xx with a JSON error, never a crash; pods without data or GPUs get neutral
scores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from itertools import compress
from operator import ne
from typing import Any

from scheduler_hints import metrics
from scheduler_hints.admission import Admission
from scheduler_hints.dra import DraInventory
from scheduler_hints.extender_wire import NodeItems, NodeNames, as_sent
from scheduler_hints.gang import GangManager
from scheduler_hints.memo import room
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.pods import VolumeIndex, pod_datasets, pod_gang, pod_gpus, pod_key
from scheduler_hints.priorities import Priorities
from scheduler_hints.request_nodes import RequestNodes
from scheduler_hints.scoring import NodeState, PodNeeds, Weights

__all__ = ["BadRequest", "Binder", "Extender", "NodeCache", "NotHeld", "RecordingBinder"]

log = logging.getLogger(__name__)



def _ci(obj: Any, key: str) -> Any:
    """``obj[key]`` matching the key case-insensitively (Go's JSON decoder does the same)."""
    if not isinstance(obj, Mapping):
        return None
    if key in obj:
        return obj[key]
    lk = key.lower()
    return next((v for k, v in obj.items() if isinstance(k, str) and k.lower() == lk), None)


class BadRequest(Exception):
    pass


class NotHeld(Exception):
    """A bind of a pod this extender does not hold for binding there (403)."""


#: Seconds after our filter let a pod through during which it may be bound to one of the nodes it passed.
BINDABLE_FOR = 300.0


class Binder:
    """Creates the Binding of a pod to a node (the real one posts ``pods/<name>/binding`` to the API server)."""

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        raise NotImplementedError


class RecordingBinder(Binder):
    """Records bindings; for tests and for dry runs."""

    def __init__(self) -> None:
        self.bindings: list[tuple[str, str, str]] = []

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        self.bindings.append((namespace, name, node))


@dataclass
class Extender:
    """The verbs over the policy core. ``topology_wait``, ``locality_wait``, ``locality_slack`` and ``clock`` are
    the admission's (:class:`~scheduler_hints.admission.Admission`, ``self.admission``)."""

    weights: Weights = field(default_factory=Weights)
    volumes: VolumeIndex | None = None
    binder: Binder = field(default_factory=RecordingBinder)
    gangs: GangManager = field(default_factory=GangManager)
    node_cache: NodeCache = field(default_factory=NodeCache)
    #: GPUs by Dynamic Resource Allocation (ResourceSlice and ResourceClaim watches when wired): the node
    #: cache's counts, pods' demand through claims, and devices allocated to claims as held GPUs.
    dra: DraInventory | None = None
    #: PodGroup minMember by ``namespace/name`` (from a PodGroup watch when wired).
    min_members: dict[str, int] = field(default_factory=dict)
    #: Pods this extender bound: pod key -> (node, GPUs). A pod watch calls :meth:`pod_gone` on deletion.
    bound_pods: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: Pods not yet on a node that request GPUs: pod key -> GPUs (from the pod watch). While those that need a
    #: whole node outnumber the whole free nodes, smaller pods pack harder (``Weights.packing_when_short``).
    pending_pods: dict[str, int] = field(default_factory=dict)
    topology_wait: InitVar[float] = 60.0
    locality_wait: InitVar[float] = 300.0
    locality_slack: InitVar[float] = 0.2
    clock: InitVar[Callable[[], float]] = time.monotonic
    admission: Admission = field(init=False)
    priorities: Priorities = field(init=False)
    _pods: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Pods our filter let through: pod key -> (the filter's reply, when). Only these may be bound, and only to
    #: a node in that reply: a forged ``/bind`` of any other pod binds nothing.
    _bindable: dict[str, tuple[list, float]] = field(default_factory=dict)
    _totals_memo: dict[tuple, dict[str, int]] = field(default_factory=dict)
    #: The last call's (node list, scores, reply) of :meth:`prioritize` and (node list, reply) of :meth:`filter`
    #: when every node passed: kube-scheduler asks pod after pod about the same nodes.
    _last_priorities: tuple[Any, list[int], list[dict[str, Any]]] | None = None
    _last_passed: tuple[Any, dict[str, Any]] | None = None
    _nodes: RequestNodes = field(init=False)
    _style_memo: tuple[Any, tuple[bool | None, tuple], list[NodeState]] | None = None

    def __post_init__(self, topology_wait: float, locality_wait: float, locality_slack: float,
                      clock: Callable[[], float]) -> None:
        if self.dra is not None:
            self.node_cache.dra = self.dra
        self._nodes = RequestNodes(self.node_cache)
        self.admission = Admission(self.node_cache, self.gangs, self.weights, topology_wait, locality_wait,
                                   locality_slack, clock)
        self.priorities = Priorities(self.node_cache, self.gangs, self.weights)

    # -- reading requests -----------------------------------------------------------------------------------
    def _args(self, body: Any) -> tuple[Mapping[str, Any], list[Mapping[str, Any]], list | None]:
        """(Pod, its candidate Node objects, the request's NodeNames list or None when it sent Node objects)."""
        if not isinstance(body, Mapping):
            raise BadRequest("expected a JSON object (ExtenderArgs)")
        pod = _ci(body, "Pod")
        if not isinstance(pod, Mapping):
            raise BadRequest("ExtenderArgs.Pod missing or not an object")
        nodes = _ci(body, "Nodes")
        names = _ci(body, "NodeNames")
        if isinstance(nodes, Mapping) and isinstance(nodes.get("items"), list):
            items, names = self._nodes.full(nodes["items"]), None
        elif isinstance(names, list):
            items = self._nodes.named(names)
        else:
            raise BadRequest("ExtenderArgs needs Nodes.items (nodeCacheCapable: false) or NodeNames (true)")
        # bounded: bind looks pods up by uid shortly after filter/prioritize
        room(self._pods, 100_000)[pod_key(pod)] = pod
        return pod, items, names

    def gpus_of(self, pod: Mapping[str, Any]) -> int:
        """GPUs the pod asks for: ``nvidia.com/gpu`` in its containers, and devices of GPU classes in its claims
        that are not allocated yet."""
        gpus = pod_gpus(pod)
        if self.dra is not None:
            gpus += self.dra.pod_gpus(pod, pod_key(pod))
        return gpus

    def _cluster_for(self, pod: Mapping[str, Any], held: Mapping[str, int]) -> list[NodeState]:
        """Every node net of ``held`` that the pod could run on as far as a gang's count goes: those its
        ``nodeSelector`` matches (Kueue writes the flavor's and the topology assignment's labels there), less the
        GPU nodes of the other style on a cluster that has both (a pod asking through resource claims only runs
        on nodes a DRA driver publishes, one asking for ``nvidia.com/gpu`` only on the others). A gang counted on
        nodes it cannot use would be admitted where only part of it can run."""
        cluster = self._nodes.cluster(held)
        raw = (pod.get("spec") or {}).get("nodeSelector")
        selector = tuple(sorted((str(k), str(v)) for k, v in raw.items())) if isinstance(raw, Mapping) else ()
        style: bool | None = None
        if self.dra is not None and self.dra.publishes_nodes():
            by_ext, by_dra = pod_gpus(pod), self.dra.pod_gpus(pod, pod_key(pod))
            if bool(by_ext) != bool(by_dra) and not (by_ext and self.dra.maps_extended_resource()):
                style = bool(by_dra)
        if not selector and style is None:
            return cluster
        memo = self._style_memo
        if memo is not None and memo[0] is cluster and memo[1] == (style, selector):
            return memo[2]
        mine = [n for n in cluster
                if (style is None or n.gpus_by_dra == style or not n.gpu_allocatable)
                and all(n.labels.get(k) == v for k, v in selector)]
        self._style_memo = (cluster, (style, selector), mine)
        return mine

    def held(self) -> dict[str, int]:
        """GPUs held per node: by bound pods' extended resources, by devices allocated to resource claims, and
        reserved for admitted gangs."""
        held: dict[str, int] = dict(self.dra.allocated_by_node()) if self.dra is not None else {}
        for n, g in self.bound_pods.values():
            if self.dra is None or self.dra.node_gpus(n) is None:  # (a DRA node's GPUs are held by claims)
                held[n] = held.get(n, 0) + g
        for n, g in self.gangs.reservations():
            held[n] = held.get(n, 0) + g
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

    # -- verbs ----------------------------------------------------------------------------------------------
    def filter(self, body: Any) -> dict[str, Any]:
        pod, items, names = self._args(body)
        reason = self._refusal(pod, items)
        failed: dict[str, str] = {}
        passed = items
        if reason:
            failed = {str((n.get("metadata") or {}).get("name", "")): reason for n in items}
            passed = []
        by_name = names is not None
        # Every node passed: the reply is the request's own list, kept for the decoder's list object (the same
        # while its bytes are). A names list the decoder made holds only names, each that of its node here.
        source = names if isinstance(names, NodeNames) else items if isinstance(items, NodeItems) else None
        if not reason and source is not None:
            last = self._last_passed
            if last is not None and last[0] is source:
                self._hold_for_binding(pod, source)
                return last[1]
        result: dict[str, Any] = {
            "Nodes": None if by_name else {"metadata": {}, "items": as_sent(passed)},
            "NodeNames": (names if not reason and source is names else
                          [str((n.get("metadata") or {}).get("name", "")) for n in passed]) if by_name else None,
            "FailedNodes": failed,
            "FailedAndUnresolvableNodes": {},
            "Error": "",
        }
        if not reason and source is not None:
            self._last_passed = (source, result)
        if passed:
            self._hold_for_binding(pod, result["NodeNames"] if by_name else passed)
        return result

    def _refusal(self, pod: Mapping[str, Any], items: list[Mapping[str, Any]]) -> str | None:
        """Why the pod may not run now (a gang not admitted, a wait for nodes holding its data), or None."""
        gang = pod_gang(pod, self.min_members)
        gpus = self.gpus_of(pod)
        if gang is not None and gang.min_member > 1 and gpus > 0:
            if self.gangs.admitted(gang):
                return None
            needs = self.needs(pod)
            score = self.priorities.locality(needs, self.node_cache.cluster()[1])
            return self.admission.gang_refusal(gang, gpus, needs, score, self._cluster_for(pod, self.held()))
        if not items or self.admission.locality_wait <= 0:
            return None
        needs = self.needs(pod)
        if not needs.datasets:
            return None
        score = self.priorities.locality(needs, self.node_cache.cluster()[1])
        return self.admission.locality_refusal(pod_key(pod), needs, score, 1, gpus,
                                               lambda: self._nodes.states(items, self.held()))

    def _hold_for_binding(self, pod: Mapping[str, Any], passed: list) -> None:
        """``passed``: the node names, or Node objects, our filter let the pod through to (kept as they are:
        looked through only if the pod is bound)."""
        room(self._bindable, 100_000)[pod_key(pod)] = (passed, self.admission.clock())

    def _check_held(self, key: str, namespace: str, name: str, node: str) -> None:
        held = self._bindable.get(key)
        if held is not None and self.admission.clock() - held[1] <= BINDABLE_FOR:
            if any(n == node if isinstance(n, str) else (n.get("metadata") or {}).get("name") == node
                   for n in held[0]):
                return
        raise NotHeld(f"pod {namespace}/{name} is not held for binding to {node}: it did not pass this extender's "
                      "filter there")

    def prioritize(self, body: Any) -> list[dict[str, Any]]:
        pod, items, _ = self._args(body)
        held = self.held()
        states = self._nodes.states(items, held)
        base_cluster, groups = self.node_cache.cluster()
        needs = self.needs(pod)
        gang = pod_gang(pod, self.min_members)
        short = self.priorities.whole_nodes_short(pod_key(pod), needs.gpus, self.pending_pods, base_cluster, held)
        if gang is None:
            scores = self.priorities.outside_gangs(needs, states, groups, short)
        else:
            scores = self.priorities.for_gang(needs, states, groups, gang, self._cluster_for(pod, held), short)
        source = self._nodes.resolved(items)  # the same hosts in the same order while it holds
        last = self._last_priorities
        if source is not None and last is not None and last[0] is source:
            if last[1] == scores:
                return last[2]
            reply = list(last[2])
            for i in compress(range(len(scores)), map(ne, scores, last[1])):
                reply[i] = {"Host": states[i].name, "Score": scores[i]}
        else:
            reply = [{"Host": s.name, "Score": score} for s, score in zip(states, scores, strict=True)]
        if source is not None:
            self._last_priorities = (source, scores, reply)
        return reply

    async def bind(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise BadRequest("expected a JSON object (ExtenderBindingArgs)")
        name, namespace = _ci(body, "PodName"), _ci(body, "PodNamespace")
        uid, node = _ci(body, "PodUID"), _ci(body, "Node")
        if not all(isinstance(v, str) and v for v in (name, namespace, node)):
            raise BadRequest("ExtenderBindingArgs needs PodName, PodNamespace and Node")
        uid = uid if isinstance(uid, str) else ""
        pod = self._pods.get(uid) or self._pods.get(f"{namespace}/{name}")
        meta = (pod or {}).get("metadata") or {}
        if pod is None or (meta.get("name"), meta.get("namespace", "default")) != (name, namespace):
            raise NotHeld(f"pod {namespace}/{name} never passed this extender's filter")
        key = pod_key(pod)
        self._check_held(key, namespace, name, node)
        del self._bindable[key]  # one bind per filter: a second (replayed) bind of the pod is refused
        gang = pod_gang(pod, self.min_members)
        gpus = self.gpus_of(pod)
        if gang is not None and gang.min_member > 1:
            complete = await self.gangs.wait_for_gang(gang, key, node, gpus)
            metrics.GANG_WAITS.labels("complete" if complete else "timeout").inc()
            if not complete:
                return {"Error": f"gang {gang.key}: fewer than {gang.min_member} members could be placed within "
                                 f"{self.gangs.bind_timeout:g}s; pod {namespace}/{name} will be retried"}
        try:
            await self.binder.bind(namespace, name, uid, node)
        except Exception as exc:  # noqa: BLE001 - reported to kube-scheduler, which retries the pod
            if gang is not None:
                self.gangs.failed(gang, key)
            metrics.BINDINGS.labels("failed").inc()
            log.warning("binding %s/%s to %s failed: %s", namespace, name, node, exc)
            return {"Error": f"binding {namespace}/{name} to {node} failed: {exc}"}
        metrics.BINDINGS.labels("bound").inc()
        self.bound_pods[key] = (node, pod_gpus(pod))  # (its claims' devices count where they are allocated)
        self.pending_pods.pop(key, None)
        if gang is not None:
            self.gangs.bound(gang, key)
        return {"Error": ""}

    # -- what the watches say -------------------------------------------------------------------------------
    def pod_pending(self, key: str, gpus: int) -> None:
        """The pod watch saw a pod that requests GPUs and is on no node yet."""
        room(self.pending_pods, 1_000_000)[key] = gpus

    def pod_gone(self, key: str) -> None:
        """A pod was deleted or finished: its GPUs are free again."""
        self.bound_pods.pop(key, None)
        self.pending_pods.pop(key, None)
        self._pods.pop(key, None)
        self._bindable.pop(key, None)

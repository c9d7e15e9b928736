"""The kube-scheduler extender: ``POST /filter``, ``/prioritize`` and ``/bind`` (aiohttp; thin glue).

Each verb is an adapter: it reads the request, asks the policy core — :mod:`.admission` (gangs all or nothing,
delay scheduling for locality) for ``/filter``, :mod:`.priorities` (scores over :mod:`.scoring`) for
``/prioritize``, the gang manager and the binding guard (:mod:`.binding_guard`) for ``/bind`` — and shapes the
reply. What the extender knows of the cluster is :mod:`.cluster_state`'s; a request's nodes, and the replies kept
for them, :mod:`.request_nodes`'s. The HTTP adapter over the verbs is :mod:`.extender_http`.

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
from itertools import compress
from operator import ne
from typing import Any

from scheduler_hints import metrics
from scheduler_hints.admission import Admission
from scheduler_hints.binding_guard import BINDABLE_FOR, BindingGuard, NotHeld
from scheduler_hints.cluster_state import ClusterState
from scheduler_hints.dra import DraInventory
from scheduler_hints.extender_wire import NodeItems, NodeNames, as_sent
from scheduler_hints.gang import GangManager
from scheduler_hints.memo import room
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.pods import VolumeIndex, pod_dataset_urls, pod_gang, pod_key, pod_wait_warm
from scheduler_hints.prewarm import PreWarm
from scheduler_hints.priorities import Priorities
from scheduler_hints.request_nodes import RequestNodes
from scheduler_hints.scoring import NodeState, PodNeeds, Weights

__all__ = ["BINDABLE_FOR", "BadRequest", "Binder", "Extender", "NodeCache", "NotHeld", "RecordingBinder"]

log = logging.getLogger(__name__)



def _ci(obj: Any, key: str) -> Any:
    """``obj[key]`` matching the key case-insensitively (Go's JSON decoder does the same)."""
    if not isinstance(obj, Mapping):
        return None
    if key in obj:
        return obj[key]
    lk = key.lower()
    return next((v for k, v in obj.items() if isinstance(k, str) and k.lower() == lk), None)


def _selector(pod: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The pod's nodeSelector as sorted ``(label, value)`` pairs."""
    raw = (pod.get("spec") or {}).get("nodeSelector")
    return tuple(sorted((str(k), str(v)) for k, v in raw.items())) if isinstance(raw, Mapping) else ()


class BadRequest(Exception):
    pass


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


class Extender:
    """The verbs over the policy core and the cluster's state (``self.state``). ``topology_wait``,
    ``locality_wait``, ``locality_slack`` and ``clock`` are the admission's
    (:class:`~scheduler_hints.admission.Admission`, ``self.admission``); the rest build the state."""

    def __init__(self, *, weights: Weights | None = None, volumes: VolumeIndex | None = None,
                 binder: Binder | None = None, gangs: GangManager | None = None, node_cache: NodeCache | None = None,
                 dra: DraInventory | None = None, min_members: dict[str, int] | None = None,
                 topology_wait: float = 60.0, locality_wait: float = 300.0, locality_slack: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.weights = weights if weights is not None else Weights()
        self.binder: Binder = binder if binder is not None else RecordingBinder()
        self.state = ClusterState(node_cache if node_cache is not None else NodeCache(),
                                  gangs if gangs is not None else GangManager(), volumes, dra,
                                  min_members if min_members is not None else {})
        self._nodes = RequestNodes(self.state.node_cache)
        self.admission = Admission(self.state.node_cache, self.state.gangs, self.weights, topology_wait,
                                   locality_wait, locality_slack, clock)
        self.priorities = Priorities(self.state.node_cache, self.state.gangs, self.weights)
        self.guard = BindingGuard(clock)
        #: Pods refused only while their data is not warm enough, by key: asked again when nodes change
        #: (:meth:`warm_now`), so that kube-scheduler tries the ones that may run now without waiting for its next
        #: event (the cluster watch touches them).
        self.warm_waiting: dict[str, Mapping[str, Any]] = {}
        #: Where pending gangs will land, warmed meanwhile (the cluster watch writes it on the nodes).
        self.prewarm = PreWarm(clock)

    # -- the state, by its old names (callers and tests read and set them) ---------------------------------------
    @property
    def node_cache(self) -> NodeCache:
        return self.state.node_cache

    @property
    def gangs(self) -> GangManager:
        return self.state.gangs

    @property
    def dra(self) -> DraInventory | None:
        return self.state.dra

    @property
    def volumes(self) -> VolumeIndex | None:
        return self.state.volumes

    @property
    def min_members(self) -> dict[str, int]:
        return self.state.min_members

    @property
    def bound_pods(self) -> dict[str, tuple[str, int]]:
        return self.state.bound_pods

    @bound_pods.setter
    def bound_pods(self, value: dict[str, tuple[str, int]]) -> None:
        self.state.bound_pods = value

    @property
    def pending_pods(self) -> dict[str, int]:
        return self.state.pending_pods

    @pending_pods.setter
    def pending_pods(self, value: dict[str, int]) -> None:
        self.state.pending_pods = value

    def held(self) -> dict[str, int]:
        return self.state.held()

    def needs(self, pod: Mapping[str, Any]) -> PodNeeds:
        return self.state.needs(pod)

    def gpus_of(self, pod: Mapping[str, Any]) -> int:
        return self.state.gpus_of(pod)

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
        self.state.saw(pod)
        return pod, items, names

    def _cluster_for(self, pod: Mapping[str, Any], held: Mapping[str, int]) -> list[NodeState]:
        """Every node net of ``held`` that the pod could run on as far as a gang's count goes: those its
        ``nodeSelector`` matches (Kueue writes the flavor's and the topology assignment's labels there), less the
        GPU nodes of the other style on a cluster that has both. A gang counted on nodes it cannot use would be
        admitted where only part of it can run."""
        return self._nodes.cluster_matching(held, self.state.gpu_style(pod), _selector(pod))

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
            kept = self._nodes.reply_for("filter", source)
            if kept is not None:
                self.guard.hold(pod_key(pod), source)
                return kept
        result: dict[str, Any] = {
            "Nodes": None if by_name else {"metadata": {}, "items": as_sent(passed)},
            "NodeNames": (names if not reason and source is names else
                          [str((n.get("metadata") or {}).get("name", "")) for n in passed]) if by_name else None,
            "FailedNodes": failed,
            "FailedAndUnresolvableNodes": {},
            "Error": "",
        }
        if not reason and source is not None:
            self._nodes.keep_reply("filter", source, result)
        if passed:
            self.guard.hold(pod_key(pod), result["NodeNames"] if by_name else passed)
        return result

    def _refusal(self, pod: Mapping[str, Any], items: list[Mapping[str, Any]]) -> str | None:
        """Why the pod may not run now (a gang not admitted, a wait for nodes holding its data), or None."""
        state = self.state
        found = pod_gang(pod, state.min_members)
        gpus = state.gpus_of(pod)
        gang = found if found is not None and found.min_member > 1 and gpus > 0 else None
        share = pod_wait_warm(pod)
        if share is not None and not (gang is not None and state.gangs.admitted(gang)):
            # (a gang is asked before it is admitted, so that while it waits it holds nothing)
            where = self._cluster_for(pod, {}) if gang is not None else self._nodes.states(items, {})
            reason = self.admission.warm_refusal(f"gang {gang.key}" if gang is not None else f"pod {pod_key(pod)}",
                                                 share, state.needs(pod), where, state.node_cache.cluster()[1])
            if reason:
                room(self.warm_waiting, 10_000)[pod_key(pod)] = pod
                return reason
            self.warm_waiting.pop(pod_key(pod), None)
        if gang is not None:
            if state.gangs.admitted(gang):
                self.prewarm.drop(gang.key)
                return None
            needs = state.needs(pod)
            base, groups = state.node_cache.cluster()
            score = self.priorities.locality(needs, groups)
            reason = self.admission.gang_refusal(gang, gpus, needs, score, self._cluster_for(pod, state.held()),
                                                 _selector(pod))
            if reason:  # it waits: warm where it will land meanwhile
                self.prewarm.plan(gang.key, pod_dataset_urls(pod, state.volumes), needs, gpus, gang.min_member,
                                  base, groups)
            else:
                self.prewarm.drop(gang.key)
            return reason
        if not items or self.admission.locality_wait <= 0:
            return None
        needs = state.needs(pod)
        if not needs.datasets:
            return None
        score = self.priorities.locality(needs, state.node_cache.cluster()[1])
        return self.admission.locality_refusal(pod_key(pod), needs, score, 1, gpus,
                                               lambda: self._nodes.states(items, state.held()), _selector(pod))

    def prioritize(self, body: Any) -> list[dict[str, Any]]:
        pod, items, _ = self._args(body)
        state = self.state
        held = state.held()
        states = self._nodes.states(items, held)
        base_cluster, groups = state.node_cache.cluster()
        needs = state.needs(pod)
        gang = pod_gang(pod, state.min_members)
        short = self.priorities.whole_nodes_short(pod_key(pod), needs.gpus, state.pending_pods, base_cluster, held)
        if gang is None:
            scores = self.priorities.outside_gangs(needs, states, groups, short)
        else:
            scores = self.priorities.for_gang(needs, states, groups, gang, self._cluster_for(pod, held), short)
        source = self._nodes.resolved(items)  # the same hosts in the same order while it holds
        last = self._nodes.reply_for("prioritize", source) if source is not None else None
        if last is not None:
            if last[0] == scores:
                return last[1]
            reply = list(last[1])
            for i in compress(range(len(scores)), map(ne, scores, last[0])):
                reply[i] = {"Host": states[i].name, "Score": scores[i]}
        else:
            reply = [{"Host": s.name, "Score": score} for s, score in zip(states, scores, strict=True)]
        if source is not None:
            self._nodes.keep_reply("prioritize", source, (scores, reply))
        return reply

    async def bind(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise BadRequest("expected a JSON object (ExtenderBindingArgs)")
        name, namespace = _ci(body, "PodName"), _ci(body, "PodNamespace")
        uid, node = _ci(body, "PodUID"), _ci(body, "Node")
        if not all(isinstance(v, str) and v for v in (name, namespace, node)):
            raise BadRequest("ExtenderBindingArgs needs PodName, PodNamespace and Node")
        uid = uid if isinstance(uid, str) else ""
        pod = self.state.pod(uid, namespace, name)
        if pod is None:
            raise NotHeld(f"pod {namespace}/{name} never passed this extender's filter")
        key = pod_key(pod)
        self.guard.take(key, namespace, name, node)
        gang = pod_gang(pod, self.state.min_members)
        gpus = self.state.gpus_of(pod)
        gangs = self.state.gangs
        if gang is not None and gang.min_member > 1:
            complete = await gangs.wait_for_gang(gang, key, node, gpus)
            metrics.GANG_WAITS.labels("complete" if complete else "timeout").inc()
            if not complete:
                return {"Error": f"gang {gang.key}: fewer than {gang.min_member} members could be placed within "
                                 f"{gangs.bind_timeout:g}s; pod {namespace}/{name} will be retried"}
        try:
            await self.binder.bind(namespace, name, uid, node)
        except Exception as exc:  # noqa: BLE001 - reported to kube-scheduler, which retries the pod
            if gang is not None:
                gangs.failed(gang, key)
            metrics.BINDINGS.labels("failed").inc()
            log.warning("binding %s/%s to %s failed: %s", namespace, name, node, exc)
            return {"Error": f"binding {namespace}/{name} to {node} failed: {exc}"}
        metrics.BINDINGS.labels("bound").inc()
        self.state.bound(key, node, pod)
        if gang is not None:
            gangs.bound(gang, key)
        return {"Error": ""}

    # -- what the watches say -------------------------------------------------------------------------------
    def pod_pending(self, key: str, gpus: int) -> None:
        """The pod watch saw a pod that requests GPUs and is on no node yet."""
        self.state.pod_pending(key, gpus)

    def pod_gone(self, key: str) -> None:
        """A pod was deleted or finished: its GPUs are free again, and it is no longer held for binding."""
        self.state.pod_gone(key)
        self.guard.forget(key)
        self.warm_waiting.pop(key, None)

    def warm_now(self) -> list[Mapping[str, Any]]:
        """The pods of :attr:`warm_waiting` whose data is now as warm as they ask on a node they could run on (by
        its selector; the filter decides): no longer kept here, for the cluster watch to have tried again."""
        groups = self.state.node_cache.cluster()[1]
        ready = []
        for key, pod in list(self.warm_waiting.items()):
            share = pod_wait_warm(pod)
            if share is None or self.admission.warm_refusal(key, share, self.state.needs(pod),
                                                            self._cluster_for(pod, {}), groups) is None:
                ready.append(self.warm_waiting.pop(key))
        return ready

"""The kube-scheduler extender: ``POST /filter``, ``/prioritize`` and ``/bind`` (aiohttp; thin).

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

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import compress
from operator import ne
from typing import Any

from aiohttp import web

from scheduler_hints import metrics
from scheduler_hints.gang import GangManager
from scheduler_hints.memo import replaced, room
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.pods import VolumeIndex, pod_datasets, pod_gang, pod_gpus, pod_key
from scheduler_hints.request_nodes import RequestNodes
from scheduler_hints.scoring import (
    NodeState,
    PodNeeds,
    Weights,
    best_slots_locality,
    defer_for_locality,
    domain_free,
    locality_scorer,
    score_nodes,
    short_hole_fit_of,
    whole_nodes_short,
)
from scheduler_hints.wire import ArgsDecoder, BadJSON, NodeItems, NodeNames, as_sent, encode

__all__ = ["MAX_BODY", "Binder", "Extender", "NodeCache", "RecordingBinder", "make_app"]

log = logging.getLogger(__name__)

#: Largest request accepted by default (ExtenderConfig.max_request_bytes): a 50 MB body is refused with a 413
#: before it is read. 5,000 node names are ~100 KB; 5,000 full Node objects (nodeCacheCapable: false) ~5-25 MB.
MAX_BODY = 32 * 1024 * 1024


def _ci(obj: Any, key: str) -> Any:
    """``obj[key]`` matching the key case-insensitively (Go's JSON decoder does the same)."""
    if not isinstance(obj, Mapping):
        return None
    if key in obj:
        return obj[key]
    lk = key.lower()
    return next((v for k, v in obj.items() if isinstance(k, str) and k.lower() == lk), None)


def _same_names(new: list[NodeState], old: list[NodeState]) -> bool:
    """Whether ``new`` names the same nodes in the same order as ``old`` (checked where it holds other objects)."""
    return new is old or (len(new) == len(old) and all(new[i].name == old[i].name for i in replaced(new, old)))


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
    weights: Weights = field(default_factory=Weights)
    volumes: VolumeIndex | None = None
    binder: Binder = field(default_factory=RecordingBinder)
    gangs: GangManager = field(default_factory=GangManager)
    node_cache: NodeCache = field(default_factory=NodeCache)
    #: PodGroup minMember by ``namespace/name`` (from a PodGroup watch when wired).
    min_members: dict[str, int] = field(default_factory=dict)
    #: Pods this extender bound: pod key -> (node, GPUs). A pod watch calls :meth:`pod_gone` on deletion.
    bound_pods: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: Pods not yet on a node that request GPUs: pod key -> GPUs (from the pod watch). While those that need a
    #: whole node outnumber the whole free nodes, smaller pods pack harder (``Weights.packing_when_short``).
    pending_pods: dict[str, int] = field(default_factory=dict)
    #: Seconds a gang that fits one topology domain waits for room there before being admitted across domains.
    topology_wait: float = 60.0
    #: Delay scheduling: seconds a pod (or gang) that could run now, but only on nodes holding clearly less of
    #: its data than the best nodes, waits for those to have room (0: never). "Clearly less": by more than
    #: ``locality_slack`` (fraction of the pod's bytes).
    locality_wait: float = 300.0
    locality_slack: float = 0.2
    clock: Callable[[], float] = time.monotonic
    _pods: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    _gang_first_seen: dict[str, float] = field(default_factory=dict)
    #: Pods our filter let through: pod key -> (the filter's reply, when). Only these may be bound, and only to
    #: a node in that reply: a forged ``/bind`` of any other pod binds nothing.
    _bindable: dict[str, tuple[list, float]] = field(default_factory=dict)
    _ready_since: dict[str, float] = field(default_factory=dict)
    _locality_memo: dict[tuple, dict[str, float | None]] = field(default_factory=dict)
    _totals_memo: dict[tuple, dict[str, int]] = field(default_factory=dict)
    _possible_memo: dict[tuple, float] = field(default_factory=dict)
    _score_memo: dict[tuple, dict[str, tuple[int, int, int]]] = field(default_factory=dict)
    _ranked_memo: dict[tuple, tuple[list[tuple[float, str]], set[str]]] = field(default_factory=dict)
    #: The last call's (datasets key, states, scores) of :meth:`_scores_outside_gangs`, (node list, scores,
    #: reply) of :meth:`prioritize`, (node list, reply) of :meth:`filter` when every node passed, and
    #: (candidates, ranking, position by name, those outside the ranking) of :meth:`_achievable`, and (question, states,
    #: cluster, scores) of :meth:`_gang_scores`: kube-scheduler asks
    #: pod after pod about the same nodes, and what did not change is not done again.
    _last_scores: tuple[tuple, list[NodeState], list[int]] | None = None
    _last_priorities: tuple[Any, list[int], list[dict[str, Any]]] | None = None
    _last_passed: tuple[Any, dict[str, Any]] | None = None
    _last_candidates: tuple[list[NodeState], set[str], dict[str, int], list[int]] | None = None
    _last_gang_scores: tuple[tuple, list[NodeState], list[NodeState], list[int]] | None = None
    _nodes: RequestNodes = field(init=False)

    def __post_init__(self) -> None:
        self._nodes = RequestNodes(self.node_cache)

    # -- parsing --------------------------------------------------------------------------------------------
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

    def _held(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for n, g in self.bound_pods.values():
            held[n] = held.get(n, 0) + g
        for n, g in self.gangs.reservations():
            held[n] = held.get(n, 0) + g
        return held

    def _needs(self, pod: Mapping[str, Any]) -> PodNeeds:
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
        return PodNeeds(totals, pod_gpus(pod))

    # -- verbs ----------------------------------------------------------------------------------------------
    def filter(self, body: Any) -> dict[str, Any]:
        pod, items, names = self._args(body)
        by_name = names is not None
        gang = pod_gang(pod, self.min_members)
        gpus = pod_gpus(pod)
        failed: dict[str, str] = {}
        passed = items
        if gang is not None and gang.min_member > 1 and gpus > 0:
            reason = None if self.gangs.admitted(gang) else self._admission_refusal(pod, gang, gpus)
        else:
            reason = self._locality_refusal(pod_key(pod), pod, 1, gpus,
                                            lambda: self._nodes.states(items, self._held())) if items else None
        if reason:
            failed = {str((n.get("metadata") or {}).get("name", "")): reason for n in items}
            passed = []
        # Every node passed: the reply is the request's own list, kept for the decoder's list object (the same
        # while its bytes are). A names list the decoder made holds only names, each that of its node here.
        source = names if isinstance(names, NodeNames) else items if isinstance(items, NodeItems) else None
        if not reason and source is not None:
            last = self._last_passed
            if last is not None and last[0] is source:
                self._hold_for_binding(pod, source)
                return last[1]
        result = {
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

    def _hold_for_binding(self, pod: Mapping[str, Any], passed: list) -> None:
        """``passed``: the node names, or Node objects, our filter let the pod through to (kept as they are:
        looked through only if the pod is bound)."""
        room(self._bindable, 100_000)[pod_key(pod)] = (passed, self.clock())

    def _check_held(self, key: str, namespace: str, name: str, node: str) -> None:
        held = self._bindable.get(key)
        if held is not None and self.clock() - held[1] <= BINDABLE_FOR:
            if any(n == node if isinstance(n, str) else (n.get("metadata") or {}).get("name") == node
                   for n in held[0]):
                return
        raise NotHeld(f"pod {namespace}/{name} is not held for binding to {node}: it did not pass this extender's "
                      "filter there")

    def _locality_refusal(self, key: str, pod: Mapping[str, Any], count: int, gpus: int,
                          candidates: Callable[[], list[NodeState]]) -> str | None:
        """Delay scheduling (:func:`~scheduler_hints.scoring.defer_for_locality`): say why ``count`` pods of
        ``gpus`` GPUs each (one pod, or a whole gang under ``key``) wait for nodes holding more of their data,
        or None to let them run. The wait counts from the first time they could run. ``candidates`` gives the
        nodes it could run on now, net of held GPUs (asked only when needed): for a pod the nodes
        kube-scheduler found feasible, for a gang the whole cluster."""
        if self.locality_wait <= 0:
            return None
        now = self.clock()
        ready = self._ready_since.get(key)
        if ready is None:
            ready = room(self._ready_since, 10_000)[key] = now
        waited = now - ready
        if waited >= self.locality_wait:
            return None
        base_cluster, groups = self.node_cache.cluster()
        needs = self._needs(pod)
        if not needs.datasets:
            return None
        score = self._locality_cache(needs, groups)
        per = max(1, gpus)
        memo_key = (tuple(sorted(needs.datasets.items())), gpus, count, self.node_cache.generation)
        possible = self._possible_memo.get(memo_key)
        if possible is None:  # the best slots as if every node were free: changes only with the node cache
            possible = room(self._possible_memo, 256)[memo_key] = best_slots_locality(
                ((score(n), n.gpu_allocatable // per if gpus else 1) for n in base_cluster), count)
        if possible <= self.locality_slack:  # nowhere holds enough of its data to be worth waiting for
            return None
        achievable = self._achievable(needs, score, base_cluster, candidates(), count, per if gpus else 0)
        if not defer_for_locality(achievable, possible, waited, wait=self.locality_wait, slack=self.locality_slack):
            return None
        what = f"gang {key} ({count} pods)" if count > 1 else f"pod {key}"
        return (f"{what} waits up to {self.locality_wait - waited:.0f}s more for nodes holding its data: the free "
                f"ones hold {achievable:.0%} of it, the best ones {possible:.0%}")

    def _achievable(self, needs: PodNeeds, score: Callable[[NodeState], float | None], base_cluster: list[NodeState],
                    candidates: list[NodeState], count: int, per: int) -> float:
        """:func:`~scheduler_hints.scoring.best_slots_locality` of the ``candidates``' free slots for ``count``
        pods of ``per`` GPUs (0: one slot a node). The cluster's nodes ranked by the pod's locality are kept
        per node-cache generation, and candidates are taken in that order only until ``count`` slots are found:
        none further down the ranking can be among the best."""
        key = (tuple(sorted(needs.datasets.items())), self.node_cache.generation)
        ranked = self._ranked_memo.get(key)
        if ranked is None:
            order = sorted(((score(n) or 0.0, n.name) for n in base_cluster), reverse=True)
            ranked = room(self._ranked_memo, 64)[key] = (order, {name for _, name in order})
        order, known = ranked
        # Where each name is among the candidates, and which are outside the ranking: the same for the next
        # list with the same names in the same order (the same nodes, a few of them holding other GPUs).
        last = self._last_candidates
        if last is None or last[1] is not known or not _same_names(candidates, last[0]):
            last = (candidates, known, {n.name: i for i, n in enumerate(candidates)},
                    [i for i, n in enumerate(candidates) if n.name not in known])
        self._last_candidates = (candidates, *last[1:])
        position, outside = last[2], last[3]
        best = [(score(candidates[i]), candidates[i].gpu_free // per if per else 1) for i in outside]
        found = 0
        for loc, name in order:
            i = position.get(name)
            if i is None:
                continue
            n = candidates[i]
            slots = n.gpu_free // per if per else 1
            if slots > 0:
                best.append((loc, slots))
                found += slots
                if found >= count:
                    break
        return best_slots_locality(best, count)

    def _admission_refusal(self, pod: Mapping[str, Any], gang, gpus: int) -> str | None:
        """Admit ``gang`` (every member ``gpus`` GPUs) or say why it waits. Capacity is counted in whole pod
        slots per node. A gang that fits waits first for nodes holding its data (:meth:`_locality_refusal`);
        then a gang that one topology domain (clique, leaf …) could hold waits up to ``topology_wait`` seconds
        for such a domain to have room before it is admitted anywhere it fits."""
        held = self._held()
        cluster = self._nodes.cluster(held)
        slots = sum(n.gpu_free // gpus for n in cluster)
        need = gang.min_member
        now = self.clock()
        if gang.key not in self._gang_first_seen:
            room(self._gang_first_seen, 10_000)
        if not self.gangs.fits(gang, gpus, slots * gpus):
            # It fits nowhere yet: the wait for one domain starts when it first fits, not before. The clock is
            # cleared, not set to now: kube-scheduler may not ask again for minutes, and a clock set at the last
            # refusal would have run out by the time GPUs free up one pod at a time (the gang was then admitted
            # at the first moment the freed GPUs added up, across domains).
            self._gang_first_seen.pop(gang.key, None)
            return f"gang {gang.key} ({need} pods × {gpus} GPUs) is waiting until the whole gang fits"
        reason = self._locality_refusal(gang.key, pod, need, gpus, lambda: cluster)
        if reason:
            return reason
        first = self._gang_first_seen.setdefault(gang.key, now)
        if now - first < self.topology_wait:
            levels = self.weights.topology_levels
            index = self.node_cache.domains(levels)
            cap = domain_free(cluster, levels, gpus, capacity=True, index=index)
            free = domain_free(cluster, levels, gpus, index=index)
            if any(c >= need for c in cap.values()) and not any(f >= need for f in free.values()):
                return (f"gang {gang.key} ({need} pods × {gpus} GPUs) is waiting for one topology domain to "
                        "have room for the whole gang")
        if self.gangs.admit(gang, gpus, slots * gpus):
            self._gang_first_seen.pop(gang.key, None)
            return None
        return f"gang {gang.key} ({need} pods × {gpus} GPUs) is waiting until the whole gang fits"

    def _locality_cache(self, needs: PodNeeds, groups) -> Callable[[NodeState], float | None]:
        """Locality depends only on the pod's datasets and the nodes' labels, so scores are kept per (datasets,
        node-cache generation): filter, prioritize and every pod of a job with the same data reuse them."""
        if not needs.datasets:
            return lambda node: None
        key = (tuple(sorted(needs.datasets.items())), self.node_cache.generation)
        memo = self._locality_memo.get(key)
        if memo is None:
            memo = room(self._locality_memo, 64)[key] = {}
        score = locality_scorer(needs, groups, self.weights)

        def cached(node: NodeState) -> float | None:
            v = memo.get(node.name)
            if v is None:
                v = memo[node.name] = score(node)
            return v

        return cached

    def prioritize(self, body: Any) -> list[dict[str, Any]]:
        pod, items, _ = self._args(body)
        held = self._held()
        states = self._nodes.states(items, held)
        base_cluster, groups = self.node_cache.cluster()
        needs = self._needs(pod)
        gang = pod_gang(pod, self.min_members)
        short = self._whole_nodes_short(pod_key(pod), needs.gpus, base_cluster, held)
        if gang is None:
            scores = self._scores_outside_gangs(needs, states, groups, short)
        else:
            scores = self._gang_scores(needs, states, groups, gang, held, short)
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

    def _scores_outside_gangs(self, needs: PodNeeds, states: list[NodeState], groups, short: bool) -> list[int]:
        """:func:`~scheduler_hints.scoring.score_nodes` for a pod outside a gang. Its score on a node depends only
        on the node's locality (memoised per node-cache generation, :meth:`_locality_cache`) and GPUs, so scores
        are kept per (datasets, GPUs, ``short``, generation): the pods of a job, scored one after another, reuse
        every node's score whose GPUs did not change, and only the others are scored again."""
        hole_fit = None
        if short and needs.gpus > 0:  # decided over every candidate, not only those scored again below
            hole_fit = short_hole_fit_of(needs, states, self._locality_cache(needs, groups), self.weights)
        key = (tuple(sorted(needs.datasets.items())), needs.gpus, short, hole_fit, self.node_cache.generation)
        last = self._last_scores
        if last is not None and last[0] == key and last[1] is states:
            return last[2]
        memo = self._score_memo.get(key)
        if memo is None:
            memo = room(self._score_memo, 64)[key] = {}
        if last is not None and last[0] == key and len(last[1]) == len(states):
            # The same nodes with a few states replaced (GPUs held): only those are looked at.
            out = list(last[2])
            check = replaced(states, last[1])
        else:
            out = [0] * len(states)
            check = range(len(states))
        todo: list[int] = []
        for i in check:
            s = states[i]
            hit = memo.get(s.name)
            if hit is not None and hit[0] == s.gpu_free and hit[1] == s.gpu_allocatable:
                out[i] = hit[2]
            else:
                todo.append(i)
        if todo:
            fresh = score_nodes(needs, [states[i] for i in todo], self._locality_cache(needs, groups), self.weights,
                                whole_nodes_short=short, hole_fit=hole_fit)
            for i, score in zip(todo, fresh, strict=True):
                s = states[i]
                memo[s.name] = (s.gpu_free, s.gpu_allocatable, score)
                out[i] = score
        self._last_scores = (key, states, out)
        return out

    def _gang_scores(self, needs: PodNeeds, states: list[NodeState], groups, gang, held: dict[str, int],
                     short: bool) -> list[int]:
        """:func:`~scheduler_hints.scoring.score_nodes` for a gang member. Its topology terms read the whole
        cluster's free GPUs, so the last answer is kept only for the same question with every node's state the
        same: a gang's pods retried while it waits for room, or several gangs' first members in a row."""
        cluster = self._nodes.cluster(held)
        on = frozenset(n for n, _ in self.gangs.placed(gang))
        key = (tuple(sorted(needs.datasets.items())), needs.gpus, gang.min_member, on, short,
               self.node_cache.generation)
        last = self._last_gang_scores
        if (last is not None and last[0] == key and len(last[1]) == len(states) and len(last[2]) == len(cluster)
                and not replaced(states, last[1]) and not replaced(cluster, last[2])):
            return last[3]
        placed = [s for s in cluster if s.name in on] if on else []
        scores = score_nodes(needs, states, self._locality_cache(needs, groups), self.weights,
                             gang_size=gang.min_member, placed=placed, cluster=cluster,
                             index=self.node_cache.domains(self.weights.topology_levels), whole_nodes_short=short)
        self._last_gang_scores = (key, states, cluster, scores)
        return scores

    def _whole_nodes_short(self, key: str, gpus: int, cluster: list[NodeState], held: dict[str, int]) -> bool:
        """:func:`~scheduler_hints.scoring.whole_nodes_short` for pod ``key`` of ``gpus`` GPUs: pending pods
        from the watch against the cluster's whole free nodes (net of ``held``)."""
        if gpus <= 0 or not self.pending_pods:  # the common cases, without a pass over the cluster
            return False
        whole = max((n.gpu_allocatable for n in cluster), default=0)
        waiting = sum(1 for k, g in self.pending_pods.items() if g >= whole and k != key)
        free = sum(1 for n in cluster if n.gpu_allocatable == whole and not held.get(n.name)) if waiting else 0
        return whole_nodes_short(gpus, whole, waiting, free)

    def pod_pending(self, key: str, gpus: int) -> None:
        """The pod watch saw a pod that requests GPUs and is on no node yet."""
        room(self.pending_pods, 1_000_000)[key] = gpus

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
        gpus = pod_gpus(pod)
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
        self.bound_pods[key] = (node, gpus)
        self.pending_pods.pop(key, None)
        if gang is not None:
            self.gangs.bound(gang, key)
        return {"Error": ""}

    def pod_gone(self, key: str) -> None:
        """A pod was deleted or finished: its GPUs are free again."""
        self.bound_pods.pop(key, None)
        self.pending_pods.pop(key, None)
        self._pods.pop(key, None)
        self._bindable.pop(key, None)


async def _body(request: web.Request, max_body: int) -> bytes:
    """The request body. With a Content-Length within ``max_body`` it is read in one join of the received
    chunks (``request.read()`` copies a 5 MB node list twice); otherwise ``request.read()`` enforces the cap."""
    length = request.content_length
    if length is None or length > max_body:
        return await request.read()
    if length == 0:  # readexactly(0) raises IncompleteReadError (was a 500 and a traceback)
        return b""
    try:
        return await request.content.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise BadJSON("request body shorter than its Content-Length") from exc


def make_app(ext: Extender, max_body: int = MAX_BODY) -> web.Application:
    """The aiohttp application: one handler per verb, JSON in and out, errors as 4xx JSON."""

    def reply(obj: Any, status: int = 200) -> web.Response:
        return web.Response(body=encode(obj), status=status, content_type="application/json")

    decoder = ArgsDecoder(ext.node_cache.nodes.get)
    #: Per verb, the last reply and its bytes: the extender hands back the same object when nothing changed
    #: (pod after pod about the same nodes), and a 5 MB filter reply is not encoded again.
    last_reply: dict[str, tuple[Any, bytes]] = {}

    def verb_reply(verb: str, obj: Any) -> web.Response:
        last = last_reply.get(verb)
        if last is None or last[0] is not obj:
            last = last_reply[verb] = (obj, encode(obj))
        return web.Response(body=last[1], content_type="application/json")

    async def handle(request: web.Request) -> web.Response:
        verb = request.match_info["verb"]
        if verb not in ("filter", "prioritize", "bind"):
            return reply({"Error": f"unknown verb {verb!r} (filter, prioritize, bind)"}, 404)
        started = time.perf_counter()
        response = await answer(verb, request)
        metrics.REQUEST_SECONDS.labels(verb).observe(time.perf_counter() - started)
        metrics.REQUESTS.labels(verb, str(response.status)).inc()
        return response

    async def answer(verb: str, request: web.Request) -> web.Response:
        try:
            body = decoder.decode(await _body(request, max_body))
        except web.HTTPRequestEntityTooLarge:
            return reply({"Error": f"request larger than {max_body} bytes"}, 413)
        except BadJSON:
            return reply({"Error": "request body is not valid JSON"}, 400)
        try:
            if verb == "filter":
                result: Any = ext.filter(body)
            elif verb == "prioritize":
                result = ext.prioritize(body)
            else:
                result = await ext.bind(body)
        except BadRequest as exc:
            return reply({"Error": str(exc)}, 400)
        except NotHeld as exc:
            metrics.BINDINGS.labels("refused").inc()
            log.warning("refused: %s", exc)
            return reply({"Error": str(exc)}, 403)
        return verb_reply(verb, result)

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=max_body)
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/{verb}", handle)
    return app


def tune_gc() -> None:
    """Move what is alive now (the node cache) out of the collector's view and collect less often: with
    5,000 nodes, full collections were the p99 of filter + prioritize (81 → 48 ms measured, bench/)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


async def serve(ext: Extender, host: str, port: int, ssl_context=None,
                max_body: int = MAX_BODY) -> None:  # pragma: no cover - CLI glue
    tune_gc()
    runner = web.AppRunner(make_app(ext, max_body), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    log.info("scheduler extender listening on %s:%d", host, port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()

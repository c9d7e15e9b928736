"""How much each node suits a pod: the policy behind the extender's ``/prioritize``, over the pure scoring
functions of :mod:`.scoring`.

kube-scheduler asks pod after pod about the same nodes, so what did not change is not scored again: a node's
locality per (datasets, node-cache generation), a pod's scores per (datasets, GPUs, generation) for every node
whose GPUs did not change, and a gang member's last answer while every node's state is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_hints.admission import Locality
from scheduler_hints.gang import GangManager
from scheduler_hints.memo import replaced, room
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.pods import GangRef
from scheduler_hints.scoring import (
    NodeState,
    PodNeeds,
    Weights,
    locality_scorer,
    score_nodes,
    short_hole_fit_of,
    whole_nodes_short,
)

__all__ = ["Priorities"]


@dataclass
class Priorities:
    node_cache: NodeCache
    gangs: GangManager
    weights: Weights = field(default_factory=Weights)
    _locality_memo: dict[tuple, dict[str, float | None]] = field(default_factory=dict)
    _score_memo: dict[tuple, dict[str, tuple[int, int, int]]] = field(default_factory=dict)
    #: The last call's (datasets key, states, scores) of :meth:`outside_gangs`, and (question, states, cluster,
    #: scores) of :meth:`for_gang`.
    _last_scores: tuple[tuple, list[NodeState], list[int]] | None = None
    _last_gang_scores: tuple[tuple, list[NodeState], list[NodeState], list[int]] | None = None

    def locality(self, needs: PodNeeds, groups) -> Locality:
        """The pod's locality on a node. It depends only on the pod's datasets and the nodes' labels, so scores are
        kept per (datasets, node-cache generation): filter, prioritize and every pod of a job with the same data
        reuse them."""
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

    def outside_gangs(self, needs: PodNeeds, states: list[NodeState], groups, short: bool) -> list[int]:
        """:func:`~scheduler_hints.scoring.score_nodes` for a pod outside a gang. Its score on a node depends only
        on the node's locality and GPUs, so scores are kept per (datasets, GPUs, ``short``, generation): the pods
        of a job, scored one after another, reuse every node's score whose GPUs did not change, and only the
        others are scored again."""
        hole_fit = None
        if short and needs.gpus > 0:  # decided over every candidate, not only those scored again below
            hole_fit = short_hole_fit_of(needs, states, self.locality(needs, groups), self.weights)
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
            check = list(range(len(states)))
        todo: list[int] = []
        for i in check:
            s = states[i]
            hit = memo.get(s.name)
            if hit is not None and hit[0] == s.gpu_free and hit[1] == s.gpu_allocatable:
                out[i] = hit[2]
            else:
                todo.append(i)
        if todo:
            fresh = score_nodes(needs, [states[i] for i in todo], self.locality(needs, groups), self.weights,
                                whole_nodes_short=short, hole_fit=hole_fit)
            for i, score in zip(todo, fresh, strict=True):
                s = states[i]
                memo[s.name] = (s.gpu_free, s.gpu_allocatable, score)
                out[i] = score
        self._last_scores = (key, states, out)
        return out

    def for_gang(self, needs: PodNeeds, states: list[NodeState], groups, gang: GangRef, cluster: list[NodeState],
                 short: bool) -> list[int]:
        """:func:`~scheduler_hints.scoring.score_nodes` for a gang member (``cluster``: every node net of held GPUs).
        Its topology terms read the whole cluster's free GPUs, so the last answer is kept only for the same question
        with every node's state the same: a gang's pods retried while it waits for room, or several gangs' first
        members in a row."""
        on = frozenset(n for n, _ in self.gangs.placed(gang))
        key = (tuple(sorted(needs.datasets.items())), needs.gpus, gang.min_member, on, short,
               self.node_cache.generation)
        last = self._last_gang_scores
        if (last is not None and last[0] == key and len(last[1]) == len(states) and len(last[2]) == len(cluster)
                and not replaced(states, last[1]) and not replaced(cluster, last[2])):
            return last[3]
        placed = [s for s in cluster if s.name in on] if on else []
        scores = score_nodes(needs, states, self.locality(needs, groups), self.weights,
                             gang_size=gang.min_member, placed=placed, cluster=cluster,
                             index=self.node_cache.domains(self.weights.topology_levels), whole_nodes_short=short)
        self._last_gang_scores = (key, states, cluster, scores)
        return scores

    @staticmethod
    def whole_nodes_short(key: str, gpus: int, pending: dict[str, int], cluster: list[NodeState],
                          held: dict[str, int]) -> bool:
        """:func:`~scheduler_hints.scoring.whole_nodes_short` for pod ``key`` of ``gpus`` GPUs: ``pending`` pods
        (from the watch) against the cluster's whole free nodes (net of ``held``)."""
        if gpus <= 0 or not pending:  # the common cases, without a pass over the cluster
            return False
        whole = max((n.gpu_allocatable for n in cluster), default=0)
        waiting = sum(1 for k, g in pending.items() if g >= whole and k != key)
        free = sum(1 for n in cluster if n.gpu_allocatable == whole and not held.get(n.name)) if waiting else 0
        return whole_nodes_short(gpus, whole, waiting, free)

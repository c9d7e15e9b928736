"""Whether a pod, or a whole gang, runs now: the policy behind the extender's ``/filter``.

* **Gangs, all or nothing** (:meth:`Admission.gang_refusal`): a gang is admitted only when every member fits,
  counted in whole pod slots per node; a gang one topology domain (clique, leaf …) could hold waits up to
  ``topology_wait`` seconds for such a domain to have room before it is admitted wherever it fits.
* **Waiting for warm data** (:meth:`Admission.warm_refusal`): a pod (or gang) annotated ``cachefs.io/wait-warm:
  "90"`` waits until 90 % of its data is cached on a node or in a cache group where it could run.
* **Delay scheduling for locality** (:meth:`Admission.locality_refusal`): a pod (or gang) that could run now, but
  only on nodes holding clearly less of its data (by more than ``locality_slack`` of its bytes) than the best
  nodes, waits up to ``locality_wait`` seconds for those to have room.

Scores are pure functions (:mod:`.scoring`); what is kept here is the waiting (since when a pod could run, since
when a gang first fitted) and memos of what repeats pod after pod.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from scheduler_hints.gang import GangManager
from scheduler_hints.memo import replaced, room
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.pods import GangRef
from scheduler_hints.scoring import (
    NodeState,
    PodNeeds,
    Weights,
    best_slots_locality,
    defer_for_locality,
    domain_free,
    warm_share,
)

__all__ = ["Admission"]

Locality = Callable[[NodeState], float | None]
#: A pod's nodeSelector as sorted ``(label, value)`` pairs.
Selector = tuple[tuple[str, str], ...]


def _percent(share: float) -> str:
    """``share`` in words for a filter's reason: kube-scheduler passes reasons through Go's fmt, which reads a
    ``%`` as a verb (an event said "30%!c(MISSING)ached")."""
    return f"{share * 100:.0f} percent"


def _duration(seconds: float) -> str:
    """``seconds`` rounded for a person: "40 s", "4 min", "2 h 5 min"."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 120 else f"{minutes // 60} h {minutes % 60} min"


def _same_names(new: list[NodeState], old: list[NodeState]) -> bool:
    """Whether ``new`` names the same nodes in the same order as ``old``."""
    return new is old or (len(new) == len(old) and all(new[i].name == old[i].name for i in replaced(new, old)))


@dataclass
class Admission:
    node_cache: NodeCache
    gangs: GangManager
    weights: Weights = field(default_factory=Weights)
    #: Seconds a gang that fits one topology domain waits for room there before being admitted across domains.
    topology_wait: float = 60.0
    #: Delay scheduling: seconds a pod (or gang) that could run now, but only on nodes holding clearly less of its
    #: data than the best nodes, waits for those to have room (0: never). "Clearly less": by more than
    #: ``locality_slack`` (fraction of the pod's bytes).
    locality_wait: float = 300.0
    locality_slack: float = 0.2
    clock: Callable[[], float] = time.monotonic
    _gang_first_seen: dict[str, float] = field(default_factory=dict)
    #: (datasets, place) of a wait-warm refusal → (when first seen, the share cached then), for its ETA.
    _warm_first_seen: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    _ready_since: dict[str, float] = field(default_factory=dict)
    _possible_memo: dict[tuple, float] = field(default_factory=dict)
    _ranked_memo: dict[tuple, tuple[list[tuple[float, str]], set[str]]] = field(default_factory=dict)
    #: The last call's (candidates, ranking, position by name, those outside the ranking) of :meth:`achievable`:
    #: kube-scheduler asks pod after pod about the same nodes.
    _last_candidates: tuple[list[NodeState], set[str], dict[str, int], list[int]] | None = None

    def locality_refusal(self, key: str, needs: PodNeeds, score: Locality, count: int, gpus: int,
                         candidates: Callable[[], list[NodeState]], selector: Selector = ()) -> str | None:
        """Delay scheduling (:func:`~scheduler_hints.scoring.defer_for_locality`): say why ``count`` pods of
        ``gpus`` GPUs each (one pod, or a whole gang under ``key``) wait for nodes holding more of their data, or
        None to let them run. The wait counts from the first time they could run. ``candidates`` gives the nodes
        it could run on now, net of held GPUs (asked only when needed): for a pod the nodes kube-scheduler found
        feasible, for a gang the whole cluster. The best it could hope for is over the nodes its ``selector`` (the
        pod's nodeSelector, ``(label, value)`` pairs) matches: a node it can never run on is not worth a wait."""
        if self.locality_wait <= 0 or not needs.datasets:
            return None
        now = self.clock()
        ready = self._ready_since.get(key)
        if ready is None:
            ready = room(self._ready_since, 10_000)[key] = now
        waited = now - ready
        if waited >= self.locality_wait:
            return None
        base_cluster = self.node_cache.cluster()[0]
        if selector:
            base_cluster = [n for n in base_cluster if all(n.labels.get(k) == v for k, v in selector)]
        per = max(1, gpus)
        memo_key = (tuple(sorted(needs.datasets.items())), gpus, count, self.node_cache.generation, selector)
        possible = self._possible_memo.get(memo_key)
        if possible is None:  # the best slots as if every node were free: changes only with the node cache
            possible = room(self._possible_memo, 256)[memo_key] = best_slots_locality(
                ((score(n), n.gpu_allocatable // per if gpus else 1) for n in base_cluster), count)
        if possible <= self.locality_slack:  # nowhere holds enough of its data to be worth waiting for
            return None
        achievable = self.achievable(needs, score, base_cluster, candidates(), count, per if gpus else 0, selector)
        if not defer_for_locality(achievable, possible, waited, wait=self.locality_wait, slack=self.locality_slack):
            return None
        what = f"gang {key} ({count} pods)" if count > 1 else f"pod {key}"
        return (f"{what} waits up to {self.locality_wait - waited:.0f}s more for nodes holding its data: the free "
                f"ones hold {_percent(achievable)} of it, the best ones {_percent(possible)}")

    def achievable(self, needs: PodNeeds, score: Locality, base_cluster: list[NodeState],
                   candidates: list[NodeState], count: int, per: int, selector: Selector = ()) -> float:
        """:func:`~scheduler_hints.scoring.best_slots_locality` of the ``candidates``' free slots for ``count``
        pods of ``per`` GPUs (0: one slot a node). The cluster's nodes ranked by the pod's locality are kept
        per node-cache generation, and candidates are taken in that order only until ``count`` slots are found:
        none further down the ranking can be among the best."""
        key = (tuple(sorted(needs.datasets.items())), self.node_cache.generation, selector)
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

    def warm_refusal(self, what: str, share: float, needs: PodNeeds, candidates: list[NodeState],
                     groups: Mapping[str, Mapping[str, float]]) -> str | None:
        """``cachefs.io/wait-warm``: why ``what`` (a pod, or a whole gang) waits for ``share`` of its data to be
        cached where it could land (``candidates``: on a node, or in the node's cache group), or None. Once the
        share there has grown, the reason says when it will be there at the rate it grew (:meth:`_warm_eta`)."""
        if not needs.datasets:
            return None
        best, where = 0.0, ""
        for node in candidates:
            got = warm_share(needs, node, groups)
            if got > best:
                best, where = got, (f"group {node.cache.cache_group}" if node.cache.cache_group else
                                    f"node {node.name}")
        if best >= share - 1e-9:
            return None
        names = ", ".join(sorted(needs.datasets))
        place = f" in {where}" if where else ""
        return (f"{what} waits for its data to be warm (cachefs.io/wait-warm {_percent(share)}): dataset {names} "
                f"is {_percent(best)} cached{place}{self._warm_eta((names, where), best, share)}")

    def _warm_eta(self, key: tuple[str, str], got: float, want: float) -> str:
        """", ETA 4 min": when ``want`` is reached at the mean rate ``got`` grew since it was first seen for
        ``key`` (datasets, place); "" until it has grown. A share that fell (eviction) starts the count over."""
        now = self.clock()
        first = self._warm_first_seen.get(key)
        if first is None or got < first[1]:
            room(self._warm_first_seen, 10_000)[key] = (now, got)
            return ""
        since, then = first
        if got <= then or now <= since:
            return ""
        return f", ETA {_duration((want - got) * (now - since) / (got - then))}"

    def gang_refusal(self, gang: GangRef, gpus: int, needs: PodNeeds, score: Locality,
                     cluster: list[NodeState], selector: Selector = ()) -> str | None:
        """Admit ``gang`` (every member ``gpus`` GPUs; ``cluster``: every node net of held GPUs) or say why it
        waits. A gang that fits waits first for nodes holding its data (:meth:`locality_refusal`), then for one
        topology domain to have room."""
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
        if not gang.topology_assigned:  # (Kueue chose its domains: waiting for others could only stall it)
            reason = self.locality_refusal(gang.key, needs, score, need, gpus, lambda: cluster, selector)
            if reason:
                return reason
        first = self._gang_first_seen.setdefault(gang.key, now)
        if now - first < self.topology_wait and not gang.topology_assigned:
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

"""Scoring as pure functions of (pod needs, node, cluster view). Each component returns a number in [0, 1]
or ``None`` when it has no signal for this pod (no datasets, no GPUs, no gang); :func:`combine` weighs the
components that have a signal and maps the result to kube-scheduler's extender scale 0–10.

Scores are absolute, not normalised to the best node: a node holding 1 % of the data should not score like
one holding 100 % just because the others hold nothing (kube-scheduler adds extender scores to its own
plugins', so inflating small differences would override them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .labels import NodeCacheView

__all__ = [
    "MAX_SCORE",
    "NodeState",
    "PodNeeds",
    "Weights",
    "best_slots_locality",
    "combine",
    "combine_scores",
    "defer_for_locality",
    "domain_free",
    "domain_index",
    "gang_domain_locality",
    "gpu_packing",
    "locality",
    "locality_scorer",
    "score_nodes",
    "whole_nodes_short",
]

MAX_SCORE = 10  # k8s.io/kube-scheduler/extender/v1 MaxExtenderPriority


@dataclass(frozen=True)
class Weights:
    local: float = 1.0
    #: Credit for bytes cached elsewhere in the node's cache group (a peer fetch is cheaper than the origin).
    domain: float = 0.3
    packing: float = 0.5
    #: Packing's weight while pods that need whole nodes wait for them: then a pod smaller than a node fills a
    #: partly used node before it breaks a whole free one, even at some cost in locality (KAI-style).
    packing_when_short: float = 2.0
    #: While whole nodes are short, how much a partly used node's packing score still depends on how tightly the
    #: pod fits it (0: every hole is as good, 1: as tight as possible). A whole free node scores 0 then, so the
    #: pod fills a hole first either way; low values let its data choose among the holes (bench/placement_sim).
    hole_fit_when_short: float = 0.25
    topology: float = 0.8
    #: Node labels naming topology levels, innermost first (NVLink domain, leaf switch, rack …).
    topology_levels: tuple[str, ...] = ("nvidia.com/gpu.clique", "network.topology.nvidia.com/block",
                                        "topology.kubernetes.io/rack")


@dataclass(frozen=True)
class PodNeeds:
    """What a pod needs: dataset ids (with byte weights when known) and GPUs."""

    datasets: Mapping[str, int] = field(default_factory=dict)  # dataset id -> total bytes (0 when unknown)
    gpus: int = 0


@dataclass(frozen=True)
class NodeState:
    name: str
    cache: NodeCacheView
    labels: Mapping[str, str] = field(default_factory=dict)
    gpu_allocatable: int = 0
    gpu_free: int = 0


def group_best(nodes: Sequence[NodeState]) -> dict[str, dict[str, list[tuple[float, str]]]]:
    """Per cache group and dataset, the two best (fraction, node) pairs: what :func:`locality` needs to give
    a node credit for its best *peer* in O(1)."""
    out: dict[str, dict[str, list[tuple[float, str]]]] = {}
    for n in nodes:
        g = n.cache.cache_group
        if not g:
            continue
        per = out.setdefault(g, {})
        for ds, frac in n.cache.fractions.items():
            entry = (frac, n.name)
            top = per.get(ds)
            if top is None:
                per[ds] = [entry]
            elif len(top) == 1:
                top.insert(0 if entry > top[0] else 1, entry)
            elif entry > top[1]:
                top[:] = [entry, top[0]] if entry > top[0] else [top[0], entry]
    return out


def locality(needs: PodNeeds, node: NodeState,
             groups: Mapping[str, Mapping[str, list[tuple[float, str]]]] | None = None, w: Weights = Weights()
             ) -> float | None:
    """Fraction of the pod's bytes cached on the node, plus ``w.domain`` × the extra fraction cached on the best
    peer of its cache group (``groups`` from :func:`group_best`; capped at 1). None when the pod reads no
    known dataset."""
    return locality_scorer(needs, groups, w)(node)


def locality_scorer(needs: PodNeeds, groups: Mapping[str, Mapping[str, list[tuple[float, str]]]] | None = None,
                    w: Weights = Weights()) -> Callable[[NodeState], float | None]:
    """:func:`locality` for one pod, with the per-pod work done once: score thousands of nodes with it."""
    if not needs.datasets:
        return lambda node: None
    raw = {d: (b if b > 0 else 1) for d, b in needs.datasets.items()}
    total = sum(raw.values())
    items = [(d, b / total) for d, b in raw.items()]
    use_domain = bool(groups) and w.domain > 0

    def score(node: NodeState) -> float:
        fractions = node.cache.fractions
        local = sum(wt * fractions.get(d, 0.0) for d, wt in items) if fractions else 0.0
        group = groups.get(node.cache.cache_group) if use_domain and node.cache.cache_group else None
        if not group:
            return min(1.0, local)
        domain = 0.0
        for d, wt in items:
            top = group.get(d)
            if not top:
                continue
            best = top[0][0] if top[0][1] != node.name else (top[1][0] if len(top) > 1 else 0.0)
            domain += wt * max(0.0, best - fractions.get(d, 0.0))
        return min(1.0, local + w.domain * domain)

    return score


def gpu_packing(needs: PodNeeds, node: NodeState, *, hole_fit: float | None = None) -> float | None:
    """Bin-packing preference: 1 when the pod fills the node's free GPUs exactly, lower the more it would
    leave free (so whole nodes stay free for big jobs). None for pods without GPUs; 0 if it does not fit.

    With ``hole_fit`` (while pods that need whole nodes wait for them: :func:`whole_nodes_short`) a whole free
    node scores 0 and a partly used one ``1 − hole_fit × (GPUs it would leave free) / allocatable``: never
    break a whole node while a hole can take the pod, and, with a small ``hole_fit``, let the pod's data
    rather than the tightest fit choose among the holes."""
    if needs.gpus <= 0:
        return None
    if node.gpu_allocatable <= 0 or node.gpu_free < needs.gpus:
        return 0.0
    left = node.gpu_free - needs.gpus
    if hole_fit is None:
        return 1.0 - left / node.gpu_allocatable
    if node.gpu_free >= node.gpu_allocatable:
        return 0.0
    return 1.0 - hole_fit * left / node.gpu_allocatable


def domain_free(cluster: Sequence[NodeState], levels: Sequence[str], pod_gpus: int = 1, *,
                capacity: bool = False) -> dict[tuple[str, str], int]:
    """Free GPUs per topology domain ``(level label, value)`` — or, with ``pod_gpus``, free pod slots (whole
    pods per node); with ``capacity``, what the domain holds when empty. Computed once per request so that
    scoring the first gang member stays O(nodes), not O(nodes²)."""
    out: dict[tuple[str, str], int] = {}
    for n in cluster:
        units = (n.gpu_allocatable if capacity else n.gpu_free) // pod_gpus
        if units <= 0:
            continue
        for key in levels:
            value = n.labels.get(key)
            if value is not None:
                out[(key, value)] = out.get((key, value), 0) + units
    return out


def gang_domain_locality(needs: PodNeeds, cluster: Sequence[NodeState], gang_size: int,
                         groups: Mapping[str, Mapping[str, list[tuple[float, str]]]] | None = None,
                         w: Weights = Weights(), score: Callable[[NodeState], float | None] | None = None
                         ) -> dict[tuple[str, str], float]:
    """Per topology domain that can hold the whole gang: the mean locality of the ``gang_size`` best free pod
    slots in it — how much of its data the gang would read locally if placed there. Lets the first member
    of a gang pick a domain by where the data is, not only by where there is room. ``score`` is the pod's
    :func:`locality_scorer` when the caller already has one."""
    if not needs.datasets or needs.gpus <= 0 or gang_size <= 0:
        return {}
    return _gang_domains(needs, cluster, gang_size, w.topology_levels, score or locality_scorer(needs, groups, w))[1]


def domain_index(cluster: Sequence[NodeState], levels: Sequence[str]) -> list[tuple[tuple[str, str], list[int]]]:
    """Each topology domain ``(level label, value)`` with the positions of its nodes in ``cluster``. Depends only
    on labels, so callers keep it while the node set is unchanged."""
    index: dict[tuple[str, str], list[int]] = {}
    for i, n in enumerate(cluster):
        for key in levels:
            value = n.labels.get(key)
            if value is not None:
                index.setdefault((key, value), []).append(i)
    return list(index.items())


def _gang_domains(needs: PodNeeds, cluster: Sequence[NodeState], gang_size: int, levels: Sequence[str],
                  score: Callable[[NodeState], float | None],
                  index: Sequence[tuple[tuple[str, str], Sequence[int]]] | None = None
                  ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], float]]:
    """For a gang's first member: free GPUs per domain (:func:`domain_free`) and :func:`gang_domain_locality`,
    from a :func:`domain_index` of ``cluster``."""
    if index is None:
        index = domain_index(cluster, levels)
    scored = bool(needs.datasets) and needs.gpus > 0 and gang_size > 0
    free_gpus = [n.gpu_free for n in cluster]
    slots = [g // needs.gpus if scored and g > 0 else 0 for g in free_gpus]
    doms = [dom for dom, _ in index]
    free_of = [0] * len(doms)
    slots_of = [0] * len(doms)
    member_of: list[list[int]] = [[] for _ in cluster]
    for d, (_, members) in enumerate(index):
        for i in members:
            member_of[i].append(d)
            free_of[d] += free_gpus[i]
            slots_of[d] += slots[i]
    free = {doms[d]: f for d, f in enumerate(free_of) if f > 0}
    by_domain: dict[tuple[str, str], float] = {}
    if scored:
        # best_slots_locality of every domain that can hold the gang, in one pass: nodes in falling (locality,
        # slots) order fill each of their domains until it has the gang's slots (the sums come out as
        # best_slots_locality's, which adds each domain's best slots in the same order).
        left = [gang_size if k >= gang_size else 0 for k in slots_of]
        total = [0.0] * len(doms)
        ranked = sorted(((score(cluster[i]) or 0.0, k, i) for i, k in enumerate(slots) if k > 0), reverse=True)
        for loc, k, i in ranked:
            for d in member_of[i]:
                want = left[d]
                if want:
                    take = k if k < want else want
                    total[d] += take * loc
                    left[d] = want - take
        by_domain = {doms[d]: total[d] / gang_size for d, k in enumerate(slots_of) if k >= gang_size}
    return free, by_domain


def best_slots_locality(nodes: Iterable[tuple[float | None, int]], count: int) -> float:
    """Mean locality of the ``count`` best pod slots, given (locality, pod slots) per node: how much of its
    data a job of ``count`` pods would read locally at best. Missing slots count as 0."""
    if count <= 0:
        return 0.0
    if count == 1:
        return max(((loc or 0.0) for loc, slots in nodes if slots > 0), default=0.0)
    total, left = 0.0, count
    for loc, slots in sorted(((loc or 0.0, slots) for loc, slots in nodes if slots > 0), reverse=True):
        take = min(slots, left)
        total += take * loc
        left -= take
        if not left:
            break
    return total / count


def whole_nodes_short(pod_gpus: int, whole_gpus: int, waiting_whole: int, whole_free: int) -> bool:
    """Whether a pod of ``pod_gpus`` GPUs should pack hard (``Weights.packing_when_short``) to keep whole nodes
    free: it needs less than a whole node (``whole_gpus``), and the pending pods that need one
    (``waiting_whole``, not counting this pod) outnumber the whole free nodes (``whole_free``)."""
    return 0 < pod_gpus < whole_gpus and waiting_whole > whole_free


def defer_for_locality(achievable: float, possible: float, waited: float, *, wait: float, slack: float) -> bool:
    """Delay scheduling: whether a pod (or a whole gang) that could be placed now, but only where it reads
    ``achievable`` of its data locally, should rather wait — up to ``wait`` seconds since it first could have
    run — for nodes that hold ``possible`` (computed as if every node were free) to have room. Waiting pays
    only when the gap is more than ``slack``; running elsewhere pulls the difference from peers or the origin."""
    return waited < wait and achievable < possible - slack


def combine(parts: Mapping[str, float | None], w: Weights = Weights()) -> int:
    """Weighted mean of the components that have a signal, as an integer 0–10. No signal at all → 0
    (neutral: every node gets the same). ``parts`` names them: locality, packing, topology."""
    return combine_scores(parts.get("locality"), parts.get("packing"), parts.get("topology"), w)


def combine_scores(loc: float | None, packing: float | None, topology: float | None, w: Weights = Weights()) -> int:
    """:func:`combine` with the components as arguments (the per-node hot path)."""
    num = den = 0.0
    for value, weight in ((loc, w.local), (packing, w.packing), (topology, w.topology)):
        if value is not None:
            num += weight * (0.0 if value < 0.0 else 1.0 if value > 1.0 else value)
            den += weight
    if den == 0:
        return 0
    return round(MAX_SCORE * num / den)


def score_nodes(needs: PodNeeds, nodes: Sequence[NodeState], locality_of: Callable[[NodeState], float | None],
                w: Weights = Weights(), *, gang_size: int = 0, placed: Sequence[NodeState] = (),
                cluster: Sequence[NodeState] = (),
                index: Sequence[tuple[tuple[str, str], Sequence[int]]] | None = None,
                whole_nodes_short: bool = False) -> list[int]:
    """The score (0–10) of each of ``nodes`` for one pod: :func:`combine` of its locality (``locality_of``, from
    :func:`locality_scorer`), GPU packing and, for a member of a gang of ``gang_size`` pods, topology: affinity
    to the members already ``placed`` or, for the first member, the smallest domain around the node that can
    hold the whole gang, with the node's locality averaged with that domain's (both from ``cluster``, the
    whole cluster's free GPUs; ``index`` its :func:`domain_index` when the caller keeps one). With
    ``whole_nodes_short`` (pods needing whole nodes wait for them) packing weighs ``w.packing_when_short`` and
    counts holes as :func:`gpu_packing` does with ``hole_fit``."""
    hole_fit = None
    if whole_nodes_short:
        w = replace(w, packing=w.packing_when_short)
        hole_fit = w.hole_fit_when_short
    levels = w.topology_levels
    step = 1.0 / (len(levels) + 1)
    first = gang_size > 0 and not placed
    free_by_domain: dict = {}
    by_domain: dict = {}
    if first:
        free_by_domain, by_domain = _gang_domains(needs, cluster, gang_size, levels, locality_of, index)
    gang_gpus = gang_size * needs.gpus
    # per level, the values the placed members have there: the innermost shared level gives the affinity
    placed_values = [{v for o in placed if (v := o.labels.get(key)) is not None} for key in levels]
    placed_names = {o.name for o in placed}
    out = []
    for n in nodes:
        loc = locality_of(n)
        topology = None
        if gang_size > 0:
            topology = 0.0
            labels = n.labels
            if first:
                mixed = loc is None
                for depth, key in enumerate(levels):
                    value = labels.get(key)
                    if value is None:
                        continue
                    dom = (key, value)
                    if not mixed and dom in by_domain:
                        loc, mixed = (loc + by_domain[dom]) / 2, True
                    if not topology and free_by_domain.get(dom, 0) >= gang_gpus:
                        topology = 1.0 - depth * step
            elif n.name in placed_names:
                topology = 1.0
            else:
                for depth, key in enumerate(levels):
                    value = labels.get(key)
                    if value is not None and value in placed_values[depth]:
                        topology = 1.0 - depth * step
                        break
        out.append(combine_scores(loc, gpu_packing(needs, n, hole_fit=hole_fit), topology, w))
    return out

"""Scoring as pure functions of (pod needs, node, cluster view). Each component returns a number in [0, 1]
or ``None`` when it has no signal for this pod (no datasets, no GPUs, no gang); :func:`combine` weighs the
components that have a signal and maps the result to kube-scheduler's extender scale 0–10.

Scores are absolute, not normalised to the best node: a node holding 1 % of the data should not score like
one holding 100 % just because the others hold nothing (kube-scheduler adds extender scores to its own
plugins', so inflating small differences would override them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .labels import NodeCacheView

__all__ = [
    "MAX_SCORE",
    "NodeState",
    "PodNeeds",
    "Weights",
    "combine",
    "domain_free",
    "first_member_locality",
    "gang_domain_locality",
    "gpu_packing",
    "locality",
    "locality_scorer",
    "topology_affinity",
]

MAX_SCORE = 10  # k8s.io/kube-scheduler/extender/v1 MaxExtenderPriority


@dataclass(frozen=True)
class Weights:
    local: float = 1.0
    #: Credit for bytes cached elsewhere in the node's cache group (a peer fetch is cheaper than the origin).
    domain: float = 0.3
    packing: float = 0.5
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
            top = per.setdefault(ds, [])
            top.append((frac, n.name))
            top.sort(reverse=True)
            del top[2:]
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


def gpu_packing(needs: PodNeeds, node: NodeState) -> float | None:
    """Bin-packing preference: 1 when the pod fills the node's free GPUs exactly, lower the more it would
    leave free (so whole nodes stay free for big jobs). None for pods without GPUs; 0 if it does not fit."""
    if needs.gpus <= 0:
        return None
    if node.gpu_allocatable <= 0 or node.gpu_free < needs.gpus:
        return 0.0
    left = node.gpu_free - needs.gpus
    return 1.0 - left / node.gpu_allocatable


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
    slots: dict[tuple[str, str], list[float]] = {}
    score = score or locality_scorer(needs, groups, w)
    for n in cluster:
        k = n.gpu_free // needs.gpus
        if k <= 0:
            continue
        loc = score(n) or 0.0
        for key in w.topology_levels:
            value = n.labels.get(key)
            if value is not None:
                slots.setdefault((key, value), []).extend([loc] * min(k, gang_size))
    out = {}
    for dom, values in slots.items():
        if len(values) >= gang_size:
            values.sort(reverse=True)
            out[dom] = sum(values[:gang_size]) / gang_size
    return out


def first_member_locality(own: float | None, node: NodeState, by_domain: Mapping[tuple[str, str], float],
                          w: Weights = Weights()) -> float | None:
    """The locality score of a gang's first member: its own node's, averaged with that of the innermost domain
    around it that can hold the whole gang (:func:`gang_domain_locality`)."""
    if own is None:
        return None
    for key in w.topology_levels:
        value = node.labels.get(key)
        if value is not None and (key, value) in by_domain:
            return (own + by_domain[(key, value)]) / 2
    return own


def topology_affinity(node: NodeState, placed: Sequence[NodeState], *, cluster: Sequence[NodeState] = (),
                      gang_gpus: int = 0, w: Weights = Weights(),
                      free_by_domain: Mapping[tuple[str, str], int] | None = None) -> float | None:
    """For gang members: how close the node is to where the gang's other members are placed — full credit
    for the innermost shared topology level, less for outer ones. For the first member, how small a
    topology domain around the node could hold the whole gang (``gang_gpus`` free GPUs in ``cluster``, or
    ``free_by_domain`` from :func:`domain_free`). None for pods outside a gang."""
    levels = w.topology_levels
    if not placed:
        if gang_gpus <= 0:
            return None
        if free_by_domain is None:
            free_by_domain = domain_free(cluster, levels)
        for depth, key in enumerate(levels):
            value = node.labels.get(key)
            if value is None:
                continue
            free = free_by_domain.get((key, value), 0)
            if free >= gang_gpus:
                return 1.0 - depth / (len(levels) + 1)
        return 0.0
    best = 0.0
    for other in placed:
        if other.name == node.name:
            return 1.0
        for depth, key in enumerate(levels):
            value = node.labels.get(key)
            if value is not None and value == other.labels.get(key):
                best = max(best, 1.0 - depth / (len(levels) + 1))
                break
    return best


def combine(parts: Mapping[str, float | None], w: Weights = Weights()) -> int:
    """Weighted mean of the components that have a signal, as an integer 0–10. No signal at all → 0
    (neutral: every node gets the same)."""
    weights = {"locality": w.local, "packing": w.packing, "topology": w.topology}
    num = den = 0.0
    for name, value in parts.items():
        if value is None:
            continue
        weight = weights[name]
        num += weight * min(1.0, max(0.0, value))
        den += weight
    if den == 0:
        return 0
    return round(MAX_SCORE * num / den)

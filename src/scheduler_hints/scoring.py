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

import numpy as np

from scheduler_hints.node_state import NodeState
from scheduler_hints.topology import DomainIndex, domain_free, domain_index, gang_domains

__all__ = [
    "MAX_SCORE",
    "NodeState",
    "PodNeeds",
    "Weights",
    "best_slots_locality",
    "combine",
    "combine_columns",
    "combine_scores",
    "defer_for_locality",
    "domain_free",
    "domain_index",
    "gang_domain_locality",
    "gpu_packing",
    "locality",
    "locality_scorer",
    "packing_column",
    "score_nodes",
    "short_hole_fit",
    "short_hole_fit_of",
    "warm_share",
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
    #: … unless the pod's locality on the holes it fits spreads by less than this: its data prefers none of
    #: them, so they are filled tightest first (hole fit 1), which frees whole nodes soonest at no cost in data.
    hole_data_spread: float = 0.1
    topology: float = 0.8
    #: Node labels naming topology levels, innermost first (NVLink domain, leaf switch, rack …). The cache group
    #: is the outermost: a gang that fits in the group holding its data is kept inside it (docs/LABELS.md).
    topology_levels: tuple[str, ...] = ("nvidia.com/gpu.clique", "network.topology.nvidia.com/block",
                                        "topology.kubernetes.io/rack", "cachefs.io/cache-group")


@dataclass(frozen=True)
class PodNeeds:
    """What a pod needs: dataset ids (with byte weights when known) and GPUs."""

    datasets: Mapping[str, int] = field(default_factory=dict)  # dataset id -> total bytes (0 when unknown)
    gpus: int = 0


def group_fractions(nodes: Sequence[NodeState]) -> dict[str, dict[str, float]]:
    """Per cache group and dataset, the fraction of the dataset the group holds: what its members published
    (``group.cachefs.io/<id>``, docs/LABELS.md), or, where none did, the sum of the members' own fractions, at
    most 1. A group shards a dataset over its members' disks (docs/CLUSTER.md: each keeps what it owns), so what
    its nodes hold adds up; where members also keep copies (``cluster.keep_guest``) the sum overcounts, which the
    cap at 1 bounds."""
    summed: dict[str, dict[str, float]] = {}
    published: dict[str, dict[str, float]] = {}
    for n in nodes:
        g = n.cache.cache_group
        if not g:
            continue
        per = summed.setdefault(g, {})
        for ds, frac in n.cache.fractions.items():
            per[ds] = min(1.0, per.get(ds, 0.0) + frac)
        pub = published.setdefault(g, {})
        for ds, frac in n.cache.group_fractions.items():
            pub[ds] = max(pub.get(ds, 0.0), frac)
    for g, pub in published.items():
        summed[g].update(pub)
    return summed


def warm_share(needs: PodNeeds, node: NodeState, groups: Mapping[str, Mapping[str, float]] | None = None
               ) -> float:
    """The share of the pod's bytes cached where it would read them on ``node``: on the node itself or in its
    cache group (``groups`` from :func:`group_fractions`), whichever holds more of each dataset."""
    if not needs.datasets:
        return 1.0
    raw = {d: (b if b > 0 else 1) for d, b in needs.datasets.items()}
    total = sum(raw.values())
    group = (groups or {}).get(node.cache.cache_group or "") or {}
    return min(1.0, sum(b / total * max(node.cache.fractions.get(d, 0.0), group.get(d, 0.0)) for d, b in raw.items()))


def locality(needs: PodNeeds, node: NodeState,
             groups: Mapping[str, Mapping[str, float]] | None = None, w: Weights = Weights()
             ) -> float | None:
    """Fraction of the pod's bytes cached on the node, plus ``w.domain`` × the fraction its cache group holds
    beyond that (``groups`` from :func:`group_fractions`: bytes a peer serves instead of the origin; capped at
    1). None when the pod reads no known dataset."""
    return locality_scorer(needs, groups, w)(node)


def locality_scorer(needs: PodNeeds, groups: Mapping[str, Mapping[str, float]] | None = None,
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
        group = groups.get(node.cache.cache_group) if groups and use_domain and node.cache.cache_group else None
        if not group:
            return min(1.0, local)
        domain = sum(wt * max(0.0, group.get(d, 0.0) - fractions.get(d, 0.0)) for d, wt in items)
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
    column = packing_column(needs.gpus, _ints([node.gpu_free]), _ints([node.gpu_allocatable]), hole_fit)
    return float(column[0])


def packing_column(pod_gpus: int, free: np.ndarray, allocatable: np.ndarray, hole_fit: float | None) -> np.ndarray:
    """:func:`gpu_packing` of a pod of ``pod_gpus`` GPUs (> 0) on nodes with these free and allocatable GPUs."""
    fits = (allocatable > 0) & (free >= pod_gpus)
    left = free - pod_gpus
    per = np.where(allocatable > 0, allocatable, 1)
    if hole_fit is None:
        value = 1.0 - left / per
    else:
        value = np.where(free >= allocatable, 0.0, 1.0 - hole_fit * left / per)
    return np.where(fits, value, 0.0)


def gang_domain_locality(needs: PodNeeds, cluster: Sequence[NodeState], gang_size: int,
                         groups: Mapping[str, Mapping[str, float]] | None = None,
                         w: Weights = Weights(), score: Callable[[NodeState], float | None] | None = None
                         ) -> dict[tuple[str, str], float]:
    """Per topology domain that can hold the whole gang: the mean locality of the ``gang_size`` best free pod
    slots in it — how much of its data the gang would read locally if placed there. Lets the first member
    of a gang pick a domain by where the data is, not only by where there is room. ``score`` is the pod's
    :func:`locality_scorer` when the caller already has one."""
    if not needs.datasets or needs.gpus <= 0 or gang_size <= 0:
        return {}
    index = domain_index(cluster, w.topology_levels)
    score = score or locality_scorer(needs, groups, w)
    found = gang_domains(index, _ints(n.gpu_free for n in cluster), _floats([score(n) for n in cluster]),
                         needs.gpus, gang_size)
    return {dom: float(v) for dom, v in zip(index.domains, found.locality.tolist(), strict=True) if v == v}


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
    """:func:`combine` with the components as arguments."""
    def column(v: float | None) -> np.ndarray | None:
        return None if v is None else _floats([v])

    return combine_columns(1, column(loc), column(packing), column(topology), w)[0]


def combine_columns(size: int, loc: np.ndarray | None, packing: np.ndarray | None, topology: np.ndarray | None,
                    w: Weights = Weights()) -> list[int]:
    """:func:`combine` for each of ``size`` nodes, each component a column over them (None: no signal for this
    pod; NaN: none on that node)."""
    num: np.ndarray | float = 0.0
    den: np.ndarray | float = 0.0
    for value, weight in ((loc, w.local), (packing, w.packing), (topology, w.topology)):
        if value is not None:
            have = ~np.isnan(value)
            num = num + np.where(have, weight * np.clip(value, 0.0, 1.0), 0.0)
            den = den + np.where(have, weight, 0.0)
    if isinstance(den, float):  # no component at all: neutral
        return [0] * size
    score = np.where(den > 0, np.rint(MAX_SCORE * num / np.where(den > 0, den, 1.0)), 0.0)
    return score.astype(np.int64).tolist()


def _ints(values: Iterable[int]) -> np.ndarray:
    return np.fromiter(values, np.int64)


def _floats(values: Sequence[float | None]) -> np.ndarray:
    """A column of floats, None as NaN."""
    return np.array(values, dtype=np.float64)


def _column(values: Sequence[float | None]) -> np.ndarray | None:
    """A component column, or None when no node has a signal."""
    column = _floats(values)
    return None if np.isnan(column).all() else column


def score_nodes(needs: PodNeeds, nodes: Sequence[NodeState], locality_of: Callable[[NodeState], float | None],
                w: Weights = Weights(), *, gang_size: int = 0, placed: Sequence[NodeState] = (),
                cluster: Sequence[NodeState] = (), index: DomainIndex | None = None,
                whole_nodes_short: bool = False, hole_fit: float | None = None) -> list[int]:
    """The score (0–10) of each of ``nodes`` for one pod: :func:`combine` of its locality (``locality_of``, from
    :func:`locality_scorer`), GPU packing and, for a member of a gang of ``gang_size`` pods, topology: affinity
    to the members already ``placed`` or, for the first member, the smallest domain around the node that can
    hold the whole gang, with the node's locality averaged with that domain's (both from ``cluster``, the
    whole cluster's free GPUs; ``index`` its :func:`~scheduler_hints.topology.domain_index` when the caller keeps
    one). With ``whole_nodes_short`` (pods needing whole nodes wait for them) packing weighs
    ``w.packing_when_short`` and counts holes as :func:`gpu_packing` does with ``hole_fit`` (by default
    :func:`short_hole_fit` over ``nodes``; callers that score a subset of the candidates pass the candidates')."""
    if not nodes:
        return []
    loc = _column([locality_of(n) for n in nodes])
    packing = None
    if needs.gpus > 0:
        free, allocatable = _ints(n.gpu_free for n in nodes), _ints(n.gpu_allocatable for n in nodes)
        if whole_nodes_short:
            w = replace(w, packing=w.packing_when_short)
            if hole_fit is None:
                hole_fit = short_hole_fit(needs.gpus, free, allocatable, loc, w)
        else:
            hole_fit = None
        packing = packing_column(needs.gpus, free, allocatable, hole_fit)
    topology = None
    if gang_size > 0 and placed:
        topology = _floats(_placed_affinity(nodes, placed, w.topology_levels))
    elif gang_size > 0:
        topology, domain_loc = _first_member_terms(needs, nodes, locality_of, gang_size, cluster, index,
                                                   w.topology_levels)
        if loc is not None:
            loc = np.where(np.isnan(domain_loc), loc, (loc + domain_loc) / 2)
    return combine_columns(len(nodes), loc, packing, topology, w)


def short_hole_fit(pod_gpus: int, free: np.ndarray, allocatable: np.ndarray, loc: np.ndarray | None,
                   w: Weights = Weights()) -> float:
    """The ``hole_fit`` of :func:`gpu_packing` while whole nodes are short, for a pod of ``pod_gpus`` GPUs on
    nodes with these free and allocatable GPUs and the pod's locality ``loc`` there (None: it reads no known
    data): ``w.hole_fit_when_short``, so that its data chooses among the holes, unless its locality on the holes
    it fits spreads by less than ``w.hole_data_spread`` — then 1, the tightest hole first."""
    holes = (free < allocatable) & (free >= pod_gpus)
    if loc is None or not holes.any():
        return 1.0
    on_holes = np.nan_to_num(loc[holes], nan=0.0)
    return 1.0 if on_holes.max() - on_holes.min() < w.hole_data_spread else w.hole_fit_when_short


def short_hole_fit_of(needs: PodNeeds, nodes: Sequence[NodeState], locality_of: Callable[[NodeState], float | None],
                      w: Weights = Weights()) -> float:
    """:func:`short_hole_fit` of a pod on ``nodes`` (for callers that score only some of them afresh)."""
    return short_hole_fit(needs.gpus, _ints(n.gpu_free for n in nodes), _ints(n.gpu_allocatable for n in nodes),
                          _column([locality_of(n) for n in nodes]), w)


def _placed_affinity(nodes: Sequence[NodeState], placed: Sequence[NodeState], levels: Sequence[str]) -> list[float]:
    """Per node, affinity to a gang's placed members: 1 on their nodes, else by the innermost level it shares
    with one of them (``1 − depth/(levels + 1)``), 0 when none."""
    step = 1.0 / (len(levels) + 1)
    # per level, the values the placed members have there: the innermost shared level gives the affinity
    placed_values = [{v for o in placed if (v := o.labels.get(key)) is not None} for key in levels]
    placed_names = {o.name for o in placed}
    out = []
    for n in nodes:
        topology = 0.0
        if n.name in placed_names:
            topology = 1.0
        else:
            labels = n.labels
            for depth, key in enumerate(levels):
                value = labels.get(key)
                if value is not None and value in placed_values[depth]:
                    topology = 1.0 - depth * step
                    break
        out.append(topology)
    return out


def _first_member_terms(needs: PodNeeds, nodes: Sequence[NodeState], locality_of: Callable[[NodeState], float | None],
                        gang_size: int, cluster: Sequence[NodeState], index: DomainIndex | None,
                        levels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """For a gang's first member, per node: the topology term (the innermost of its domains with free GPUs for
    the whole gang scores ``1 − depth/(levels + 1)``, none 0) and the gang locality of the innermost of its
    domains that can hold the gang (NaN: none can)."""
    if index is None or not index.covers(cluster, levels):
        index = domain_index(cluster, levels)
    localities = _column([locality_of(n) for n in cluster]) if needs.datasets else None
    if localities is not None:
        localities = np.nan_to_num(localities, nan=0.0)
    found = gang_domains(index, _ints(n.gpu_free for n in cluster), localities, needs.gpus, gang_size)
    step = 1.0 / (len(levels) + 1)
    where = index.locate(nodes)
    topology = np.zeros(len(nodes))
    domain_loc = np.full(len(nodes), np.nan)
    for depth in range(len(levels) - 1, -1, -1):  # outermost first, so that inner levels overwrite
        d = where[depth]
        known = d >= 0
        safe = np.where(known, d, 0)
        free = np.where(known, found.free[safe] if len(index.domains) else 0, 0)
        topology = np.where((d != -1) & (free >= gang_size * needs.gpus), 1.0 - depth * step, topology)
        dl = np.where(known, found.locality[safe] if len(index.domains) else np.nan, np.nan)
        domain_loc = np.where(np.isnan(dl), domain_loc, dl)
    return topology, domain_loc

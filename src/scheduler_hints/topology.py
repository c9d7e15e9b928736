"""Topology domains of a cluster (NVLink clique, leaf switch, rack …) and what a gang's first member needs from
them, computed over the whole cluster in a few array operations per request.

A gang's first member is scored against every domain that could hold the whole gang: the domain's free GPUs
(topology fit) and the mean locality of its best free pod slots (where the gang's data is). Both are sums over
each domain's nodes, so they are computed with the cluster as arrays — one pass of Python per node would cost
~25 ms for 5,000 nodes, over half of the extender's 50 ms budget (bench/extender_bench.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scheduler_hints.node_state import NodeState

__all__ = ["UNKNOWN_DOMAIN", "DomainIndex", "GangDomains", "domain_free", "domain_index", "domain_sums",
           "gang_domains"]

#: The domain id of a node that has a level's label whose value the index does not know (a node outside it).
UNKNOWN_DOMAIN = -2
_NO_LABEL = -1


@dataclass(frozen=True, eq=False)
class DomainIndex:
    """The topology domains of a list of nodes (a cluster). Domain ``d`` is ``domains[d]``, a ``(level label,
    value)`` pair, at depth ``depth[d]`` (its level's position in ``levels``, 0 innermost). ``level_domain[l, i]``
    is the domain of node ``i`` at level ``l`` (-1: no such label). Depends only on labels, so callers keep it
    while the nodes and their topology labels are unchanged."""

    levels: tuple[str, ...]
    domains: list[tuple[str, str]]
    depth: np.ndarray
    level_domain: np.ndarray
    position: dict[str, int]
    #: Every (domain, node) membership: ``entry_domain[e]`` holds node ``entry_node[e]``.
    entry_domain: np.ndarray
    entry_node: np.ndarray

    def members(self) -> dict[tuple[str, str], list[int]]:
        """Each domain with the positions of its nodes (for people and tests; scoring uses the arrays)."""
        out: dict[tuple[str, str], list[int]] = {dom: [] for dom in self.domains}
        for d, i in sorted(zip(self.entry_domain.tolist(), self.entry_node.tolist(), strict=True)):
            out[self.domains[d]].append(i)
        return out

    def covers(self, cluster: Sequence[NodeState], levels: Sequence[str]) -> bool:
        """Whether this index is of ``cluster`` at ``levels`` (the same nodes in the same order, as far as a cheap
        check sees): a caller's kept index stands in for building one."""
        if self.levels != tuple(levels) or len(self.position) != len(cluster):
            return False
        return not cluster or (self.position.get(cluster[0].name) == 0
                               and self.position.get(cluster[-1].name) == len(cluster) - 1)

    def locate(self, nodes: Sequence[NodeState]) -> np.ndarray:
        """``level_domain`` for ``nodes``, which may be other objects than the indexed ones: by name when
        indexed, otherwise from their labels (:data:`UNKNOWN_DOMAIN` for a value the index lacks)."""
        position = self.position
        rows = np.fromiter((position.get(n.name, -1) for n in nodes), np.int64, len(nodes))
        out = self.level_domain[:, rows] if position else np.full((len(self.levels), len(nodes)), _NO_LABEL, np.int64)
        missing = np.flatnonzero(rows < 0).tolist()
        if missing:
            ids = {dom: d for d, dom in enumerate(self.domains)}
            for k in missing:
                for lvl, key in enumerate(self.levels):
                    value = nodes[k].labels.get(key)
                    out[lvl, k] = _NO_LABEL if value is None else ids.get((key, value), UNKNOWN_DOMAIN)
        return out


def domain_index(cluster: Sequence[NodeState], levels: Sequence[str]) -> DomainIndex:
    """The :class:`DomainIndex` of ``cluster`` for topology ``levels`` (innermost first)."""
    levels = tuple(levels)
    ids: dict[tuple[str, str], int] = {}
    level_domain = np.full((len(levels), len(cluster)), _NO_LABEL, np.int64)
    for lvl, key in enumerate(levels):
        row = [_NO_LABEL] * len(cluster)
        for i, n in enumerate(cluster):
            value = n.labels.get(key)
            if value is not None:
                row[i] = ids.setdefault((key, value), len(ids))
        level_domain[lvl] = row
    domains = list(ids)
    flat = level_domain.ravel()
    known = flat >= 0
    return DomainIndex(levels, domains, np.array([levels.index(k) for k, _ in domains], np.int64), level_domain,
                       {n.name: i for i, n in enumerate(cluster)}, flat[known],
                       np.tile(np.arange(len(cluster)), len(levels))[known])


def domain_sums(index: DomainIndex, per_node: np.ndarray) -> np.ndarray:
    """Per domain of ``index``, the sum of ``per_node`` (one integer per indexed node) over the domain's nodes."""
    return np.bincount(index.entry_domain, weights=per_node[index.entry_node],
                       minlength=len(index.domains)).astype(np.int64)


def domain_free(cluster: Sequence[NodeState], levels: Sequence[str], pod_gpus: int = 1, *,
                capacity: bool = False, index: DomainIndex | None = None) -> dict[tuple[str, str], int]:
    """Free GPUs per topology domain ``(level label, value)`` that has any — or, with ``pod_gpus``, free pod
    slots (whole pods per node); with ``capacity``, what the domain holds when empty. ``index``: the
    :func:`domain_index` of ``cluster`` when the caller keeps one."""
    if index is None or not index.covers(cluster, levels):
        index = domain_index(cluster, levels)
    units = np.fromiter(((n.gpu_allocatable if capacity else n.gpu_free) // pod_gpus for n in cluster), np.int64,
                        len(cluster))
    sums = domain_sums(index, np.maximum(units, 0))
    return {dom: total for dom, total in zip(index.domains, sums.tolist(), strict=True) if total > 0}


@dataclass(frozen=True, eq=False)
class GangDomains:
    """Per domain of a :class:`DomainIndex`: free GPUs, and the gang locality (mean locality of the gang's
    best free pod slots there; NaN where the domain cannot hold the whole gang)."""

    free: np.ndarray
    locality: np.ndarray


def gang_domains(index: DomainIndex, free_gpus: np.ndarray, localities: np.ndarray | None, pod_gpus: int,
                 gang_size: int) -> GangDomains:
    """:class:`GangDomains` for a gang of ``gang_size`` pods of ``pod_gpus`` GPUs each, given each indexed
    node's free GPUs and locality (None: the pod reads no known data, so every domain's locality is NaN).

    The locality of a domain is computed as :func:`~scheduler_hints.scoring.best_slots_locality` of its nodes
    would, bit for bit: its nodes in falling (locality, slots) order add ``slots taken × locality`` until the
    gang has its slots (nodes with no slot or no data add nothing, so they are left out)."""
    free = domain_sums(index, free_gpus)
    by_domain = np.full(len(index.domains), np.nan)
    if localities is None or pod_gpus <= 0 or gang_size <= 0:
        return GangDomains(free, by_domain)
    slots = np.where(free_gpus > 0, free_gpus // pod_gpus, 0)
    entry_slots = slots[index.entry_node]
    slots_of = domain_sums(index, slots)
    entry_loc = localities[index.entry_node]
    useful = (entry_slots > 0) & (entry_loc > 0)
    dom, k, loc = index.entry_domain[useful], entry_slots[useful], entry_loc[useful]
    order = np.lexsort((-k, -loc, dom))  # by domain, then falling locality, then falling slots
    dom, k, loc = dom[order], k[order], loc[order]
    before = np.cumsum(k) - k  # slots ahead of each entry, counted from the first domain's start …
    starts = np.flatnonzero(np.r_[True, dom[1:] != dom[:-1]]) if len(dom) else np.empty(0, np.int64)
    group_start = np.repeat(starts, np.diff(np.r_[starts, len(dom)]))
    before = before - before[group_start]  # … and from its own domain's start
    take = np.clip(gang_size - before, 0, k)
    total = np.bincount(dom, weights=take * loc, minlength=len(index.domains))
    holds = slots_of >= gang_size
    by_domain[holds] = total[holds] / gang_size
    return GangDomains(free, by_domain)

"""Warming where a pending gang will land (docs/SCHEDULING.md): while a gang that reads datasets waits for GPUs, the
cache group it will run in is warmed, so that it starts warm the moment its GPUs free up.

The extender picks that group when it refuses the gang for room (:meth:`PreWarm.plan`): of the cache groups whose
GPUs could hold the whole gang, the one closest to having room for it (most free pod slots now: where it will fit
first, and be placed, when GPUs free up), then the one holding most of its data already. The cluster watch writes
what each group should warm into the ConfigMap ``cachefs-system/cachefs-warm-for`` (one key per cache group, a JSON
list of dataset URLs; :meth:`PreWarm.wanted`), and each node agent warms its share of its group's as it does a
CacheDataset's (the group reads each byte from the origin once). A target is dropped when the gang is admitted, and
ends by itself when the gang has not been asked about for :data:`TARGET_TTL` seconds (kube-scheduler asks about a
pending pod at least every five minutes). A ConfigMap rather than an annotation on each Node: the extender needs no
right to change Nodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler_hints.memo import room
from scheduler_hints.node_state import NodeState
from scheduler_hints.scoring import PodNeeds, warm_share

__all__ = ["REPLAN_EVERY", "TARGET_TTL", "PreWarm", "WarmTarget"]

#: Seconds a pending gang's target lives after the extender last refused it.
TARGET_TTL = 600.0


#: Seconds a gang's target stands before a refusal chooses again (the choice walks every node; the cluster watch
#: writes the targets this often anyway).
REPLAN_EVERY = 5.0


@dataclass(frozen=True)
class WarmTarget:
    group: str
    urls: tuple[str, ...]
    seen: float
    planned: float = 0.0


@dataclass
class PreWarm:
    clock: Callable[[], float] = time.monotonic
    #: Pending gang key → where it will land and what it reads.
    targets: dict[str, WarmTarget] = field(default_factory=dict)

    def plan(self, gang: str, urls: Sequence[str], needs: PodNeeds, gpus: int, members: int,
             cluster: Sequence[NodeState], groups: Mapping[str, Mapping[str, float]]) -> str | None:
        """The cache group gang ``gang`` (``members`` pods of ``gpus`` GPUs, reading ``urls``) will land in, now
        its target; None (and no target) when it reads nothing or no group could hold it."""
        if not urls or gpus <= 0:
            self.targets.pop(gang, None)
            return None
        now = self.clock()
        known = self.targets.get(gang)
        if known is not None and now - known.planned < REPLAN_EVERY:  # (a refusal per pod: walk the nodes rarely)
            self.targets[gang] = replace(known, seen=now)
            return known.group
        slots: dict[str, list[int]] = {}  # group → [pod slots of its GPUs, free slots now]
        best_share: dict[str, float] = {}
        for n in cluster:
            g = n.cache.cache_group
            if not g:
                continue
            s = slots.setdefault(g, [0, 0])
            s[0] += n.gpu_allocatable // gpus
            s[1] += n.gpu_free // gpus
            best_share[g] = max(best_share.get(g, 0.0), warm_share(needs, n, groups))
        fitting = [(s[1], best_share[g], g) for g, s in slots.items() if s[0] >= members]
        if not fitting:
            self.targets.pop(gang, None)
            return None
        group = max(fitting)[2]
        room(self.targets, 10_000)[gang] = WarmTarget(group, tuple(sorted(set(urls))), now, now)
        return group

    def drop(self, gang: str) -> None:
        """The gang was admitted (or is gone): its group need not be warmed for it any more."""
        self.targets.pop(gang, None)

    def wanted(self) -> dict[str, list[str]]:
        """Per cache group, the URLs to warm there for the gangs that will land in it. Targets not refreshed for
        :data:`TARGET_TTL` seconds end here."""
        now = self.clock()
        for gang in [k for k, t in self.targets.items() if now - t.seen > TARGET_TTL]:
            del self.targets[gang]
        out: dict[str, set[str]] = {}
        for t in self.targets.values():
            out.setdefault(t.group, set()).update(t.urls)
        return {g: sorted(urls) for g, urls in sorted(out.items())}

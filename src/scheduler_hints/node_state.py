"""A node as scoring sees it: its name, what its cache labels say, its labels, and its GPUs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler_hints.labels import NodeCacheView

__all__ = ["NodeState"]


@dataclass(frozen=True)
class NodeState:
    name: str
    cache: NodeCacheView
    labels: Mapping[str, str] = field(default_factory=dict)
    gpu_allocatable: int = 0
    gpu_free: int = 0
    #: Its GPUs are DRA devices (ResourceSlices), not the ``nvidia.com/gpu`` extended resource: pods that ask
    #: through resource claims run here, pods that ask for the extended resource do not (and the reverse).
    gpus_by_dra: bool = False

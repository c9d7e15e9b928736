"""The placement simulator's cachefs policy with its GPUs handed out by DRA (``python -m bench.placement_sim --dra``).

The cluster and jobs are the same; what changes is where the extender's view comes from: every node's 8 GPUs are
devices in a ResourceSlice whose attributes carry the NVLink clique (the Node has no clique label and no
``nvidia.com/gpu``), each job's pods ask for their GPUs through a ResourceClaimTemplate, and every placed pod's
devices are allocated in a ResourceClaim, as kube-scheduler's DRA plugin does. Node states are read through the
extender's own :class:`~scheduler_hints.dra.DraInventory` and :class:`~scheduler_hints.node_cache.NodeCache`
(capacity, free GPUs net of allocated devices, the clique level), and every state is checked against the
simulator's own bookkeeping; the figures must match the extended-resource run (within 2 %).
"""

from __future__ import annotations

from dataclasses import replace

from bench.placement_sim import GPUS, Job, Node, Simulation
from scheduler_hints.dra import DraConfig, DraInventory
from scheduler_hints.labels import NodeCacheView
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.scoring import NodeState

DRIVER = "gpu.nvidia.com"


def gpu_slice(n: Node) -> dict:
    return {"metadata": {"name": f"{n.name}-gpus"}, "spec": {
        "driver": DRIVER, "nodeName": n.name, "pool": {"name": n.name, "generation": 1},
        "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, "cliqueId": {"string": n.clique}}}
                    for i in range(GPUS)]}}


class DraSimulation(Simulation):
    """The ``cachefs`` policy over DRA (its result is labelled ``cachefs-dra``)."""

    def __init__(self, nodes: list[Node], sizes: dict[str, int], jobs: list[Job], seed: int, **kw) -> None:
        super().__init__("cachefs", nodes, sizes, jobs, seed, **kw)
        self.result.policy = "cachefs-dra"
        self.dra = DraInventory(DraConfig(topology_attributes={f"{DRIVER}/cliqueId": "clique"}))
        self.node_cache = NodeCache(dra=self.dra)
        self._objects: dict[str, dict] = {}
        self._free_devices: dict[str, list[str]] = {}
        for n in nodes:
            self.dra.on_slice("ADDED", gpu_slice(n))
            obj = {"metadata": {"name": n.name, "labels": {"leaf": n.leaf}, "resourceVersion": "1"}, "status": {}}
            self._objects[n.name] = obj
            self.node_cache.update(obj)
            self._free_devices[n.name] = [f"gpu-{i}" for i in range(GPUS)]
        self.node_cache.dra_changed()
        for gpus in sorted({j.gpus for j in jobs}):
            self.dra.on_template("ADDED", {"metadata": {"name": f"gpus-{gpus}", "namespace": "sim"}, "spec": {"spec": {
                "devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": gpus}}]}}}})
        self._claims: dict[int, list[tuple[dict, str, list[str]]]] = {}
        self.checked_states = 0

    def demand(self, job: Job) -> int:
        """What the extender reads as one pod's GPUs: its claim from the template."""
        pod = {"metadata": {"name": f"job-{job.id}", "namespace": "sim"},
               "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": f"gpus-{job.gpus}"}]}}
        return self.dra.pod_gpus(pod, f"sim/job-{job.id}")

    def state(self, n: Node) -> NodeState:
        base = self.node_cache.base_state(self._objects[n.name])
        free = base.gpu_allocatable - self.dra.allocated_by_node().get(n.name, 0)
        assert free == n.free and base.labels.get("clique") == n.clique, (n.name, free, n.free, base.labels)
        self.checked_states += 1
        s = self._states.get(n.name)
        if s is None:
            fr = {ds: b / self.sizes[ds] for ds, b in self.held(n).items()}
            view = NodeCacheView(n.name, fr, dict(self.held(n)), n.leaf)
            s = NodeState(n.name, view, dict(base.labels), base.gpu_allocatable, free, True)
            self._states[n.name] = s
        elif s.gpu_free != free:
            s = replace(s, gpu_free=free)
            self._states[n.name] = s
        return s

    def take(self, job: Job, name: str) -> None:
        assert self.demand(job) == job.gpus
        devices = [self._free_devices[name].pop() for _ in range(job.gpus)]
        claim = {"metadata": {"name": f"job-{job.id}-{len(job.placed)}", "namespace": "sim"}, "status": {
            "allocation": {"devices": {"results": [{"request": "gpus", "driver": DRIVER, "pool": name, "device": d}
                                                   for d in devices]}}}}
        self.dra.on_claim("ADDED", claim)
        self._claims.setdefault(job.id, []).append((claim, name, devices))
        super().take(job, name)

    def release(self, job: Job) -> None:
        for claim, name, devices in self._claims.pop(job.id, []):
            self.dra.on_claim("DELETED", claim)
            self._free_devices[name].extend(devices)
        super().release(job)

"""The placement simulator's cachefs policy with its GPUs handed out by DRA, beside the same policy over the
``nvidia.com/gpu`` extended resource in the same run:

    python -m bench.placement_dra [--nodes 1024] [--jobs 1500] [--seeds 7]

The cluster and jobs are the same as bench/placement_sim.py's; what changes is where the extender's view comes
from: every node's 8 GPUs are devices in a ResourceSlice whose attributes carry the NVLink clique (the Node has
no clique label and no ``nvidia.com/gpu``), each job's pods ask for their GPUs through a ResourceClaimTemplate,
and every placed pod's devices are allocated in a ResourceClaim, as kube-scheduler's DRA plugin does. Node states
are read through the extender's own :class:`~scheduler_hints.dra.DraInventory` and
:class:`~scheduler_hints.node_cache.NodeCache` (capacity, free GPUs net of allocated devices, the clique level),
and every state is checked against the simulator's own bookkeeping; the figures must match the extended-resource
run (within 2 %).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from bench.placement_sim import GPUS, Job, Node, Result, Simulation, make_world, table
from scheduler_hints.dra import DraConfig, DraInventory
from scheduler_hints.labels import NodeCacheView
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.scoring import NodeState

DRIVER = "gpu.nvidia.com"


def gpu_slice(node: str, clique: str, gpus: int = GPUS) -> dict:
    """The ResourceSlice a DRA driver publishes for ``node``: ``gpus`` GPUs in NVLink clique ``clique``."""
    return {"metadata": {"name": f"{node}-gpus"}, "spec": {
        "driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 1},
        "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, "cliqueId": {"string": clique}}}
                    for i in range(gpus)]}}


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
            self.dra.on_slice("ADDED", gpu_slice(n.name, n.clique))
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


def compare_dra(ext: Result, dra: Result) -> None:
    """The DRA run's figures against the extended-resource run's: the target is within 2 % on each."""
    figures = [("local fraction", ext.local_fraction, dra.local_fraction),
               ("node-or-group fraction", ext.group_fraction, dra.group_fraction),
               ("origin bytes", ext.origin_bytes, dra.origin_bytes),
               ("mean wait", statistics.fmean(ext.waits or [0]), statistics.fmean(dra.waits or [0])),
               ("stranded GPU-hours", ext.stranded_area, dra.stranded_area),
               ("multi-leaf gangs", ext.multi_leaf, dra.multi_leaf)]
    worst = max(abs(b / a - 1) if a else abs(b) for _, a, b in figures)
    print("DRA vs extended resources: " + ", ".join(f"{name} {b / a if a else 1.0:.3f}×" for name, a, b in figures)
          + f"; largest difference {worst:.1%} ({'within' if worst <= 0.02 else 'outside'} the 2 % target)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=1500)
    ap.add_argument("--seeds", default="7", help="comma-separated seeds")
    args = ap.parse_args()
    for seed in (int(x) for x in args.seeds.split(",")):
        ext = Simulation("cachefs", *make_world(args.nodes, args.jobs, seed), seed=seed).run()
        dra = DraSimulation(*make_world(args.nodes, args.jobs, seed), seed=seed).run()
        print(f"placement simulation: {args.nodes} nodes × {GPUS} GPUs, {args.jobs} jobs, seed {seed}")
        print(table([ext, dra]))
        compare_dra(ext, dra)
        print(flush=True)


if __name__ == "__main__":
    main()

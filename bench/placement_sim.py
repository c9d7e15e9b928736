"""Placement simulator: one seeded GPU cluster and job stream, placed by three policies.

    python -m bench.placement_sim [--nodes 1024] [--jobs 1500] [--seeds 7,3,5,11] [--locality-wait HOURS]

Cluster: ``nodes`` × 8 GPUs; NVLink cliques of 8 nodes, leaves (network blocks, also the cache groups) of 32.
Each node has ``cache_tib`` of NVMe. Datasets (10 GB–10 TB, log-uniform, Zipf popularity) start cached on a
few leaves. Jobs (1–64 pods, Poisson arrivals, exponential run times) read their dataset, sharded over their
pods; whatever a pod reads is then cached on its node (LRU by dataset). Policies:

(a) ``default``  kube-scheduler's least-allocated spreading, pods placed one by one (no gang support);
(b) ``fluid``    (a) plus Fluid-style boolean dataset affinity: prefer nodes labelled as holding any of it;
(a+g) ``default+gang`` (a) with the same all-or-nothing gang admission as ours (like coscheduling), to compare
                 fragmentation with placement alone changed;
(c) ``cachefs``  our extender's scoring functions (byte-weighted locality with cache-group credit, GPU
                 packing, gang topology), its gang admission (a gang is placed whole or not at all) and its
                 delay scheduling (a job that could run now, but only on nodes holding clearly less of its
                 data than the best ones, waits up to ``locality_wait`` for those to have room).

With ``--sharded``, every leaf is a cache group as cachefs runs it (docs/CLUSTER.md): the group holds each byte
of a dataset once, spread evenly over its members' disks (LRU by dataset over the group's total capacity), and a
pod reads what its group holds from the owning member: 1/members of it from its own disk, the rest from peers.
Nodes then publish their own share and their group's fraction (docs/LABELS.md), which the extender scores.

Reported: fraction of bytes read from the pod's own node, and from the node or its cache group (what beats
object storage), bytes pulled from object storage, mean and p95
gang wait, partial-gang deadlocks (no job running, partial gangs holding GPUs, nothing placeable; broken by
releasing the newest partial gang, as a permit timeout would), GPUs stranded on fragmented nodes (time-mean
of free GPUs on partly used nodes while an 8-GPU job is held up for want of whole free nodes), and gangs
spread over more than one leaf.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from scheduler_hints.labels import NodeCacheView
from scheduler_hints.scoring import (
    NodeState,
    PodNeeds,
    Weights,
    best_slots_locality,
    defer_for_locality,
    group_fractions,
    locality_scorer,
    score_nodes,
    whole_nodes_short,
)

GPUS = 8
CLIQUE = 8
LEAF = 32
TB = 10**12
POLICIES = ("default", "default+gang", "fluid", "cachefs")
#: The extender's ``locality_wait`` in simulated hours (jobs run 8 h on average) and its ``locality_slack``.
LOCALITY_WAIT = 2.0
LOCALITY_SLACK = 0.2


@dataclass
class Node:
    name: str
    clique: str
    leaf: str
    capacity: int
    free: int = GPUS
    cache: OrderedDict = field(default_factory=OrderedDict)  # dataset -> cached bytes, LRU order

    def used_bytes(self) -> int:
        return sum(self.cache.values())

    def add(self, ds: str, nbytes: int, size: int) -> None:
        have = self.cache.pop(ds, 0)
        self.cache[ds] = min(size, have + nbytes, self.capacity)
        while self.used_bytes() > self.capacity and len(self.cache) > 1:
            self.cache.popitem(last=False)


class ShardedGroup(Node):
    """A leaf as one cache group: ``cache`` is what the group holds (each byte once), ``capacity`` the members'
    disks together; each member holds an equal share of every dataset."""


@dataclass
class Job:
    id: int
    arrival: float
    pods: int
    gpus: int
    dataset: str
    duration: float
    placed: list[str] = field(default_factory=list)
    ready_at: float | None = None  # when the whole job first fit (the locality wait counts from there)


@dataclass
class Result:
    policy: str
    local_bytes: int = 0
    peer_bytes: int = 0
    origin_bytes: int = 0
    waits: list[float] = field(default_factory=list)
    deadlocks: int = 0
    stranded_area: float = 0.0
    span: float = 0.0
    partial_gpu_hours: float = 0.0
    multi_leaf: int = 0
    gangs: int = 0
    gang_bytes: int = 0  # what gangs read (their first epoch)
    gang_cached_bytes: int = 0  # ... of it from their node or cache group
    prewarm_bytes: int = 0  # read from object storage ahead of pending gangs (``prewarm_tbph``)

    @property
    def total(self) -> int:
        return self.local_bytes + self.peer_bytes + self.origin_bytes

    @property
    def local_fraction(self) -> float:
        return self.local_bytes / self.total if self.total else 0.0

    @property
    def group_fraction(self) -> float:
        """Bytes read from the pod's node or its cache group."""
        return (self.local_bytes + self.peer_bytes) / self.total if self.total else 0.0


def make_world(n_nodes: int, n_jobs: int, seed: int, cache_tib: float = 15.0, n_datasets: int = 60,
               load: float = 0.9):
    rng = random.Random(seed)
    nodes = [Node(f"n{i}", f"c{i // CLIQUE}", f"l{i // LEAF}", int(cache_tib * 2**40)) for i in range(n_nodes)]
    sizes = {f"ds{i}": int(10 ** rng.uniform(10, 13)) for i in range(n_datasets)}  # 10 GB .. 10 TB
    leaves = sorted({n.leaf for n in nodes})
    for ds, size in sizes.items():  # warm start: each dataset sits on the nodes of one or two leaves
        for leaf in rng.sample(leaves, min(len(leaves), rng.choice((1, 1, 2)))):
            members = [n for n in nodes if n.leaf == leaf]
            for n in rng.sample(members, max(1, len(members) // 2)):
                n.add(ds, min(size, n.capacity // 4), size)
    names = list(sizes)
    popularity = [1 / (i + 1) ** 1.1 for i in range(len(names))]
    shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8), (16, 8), (32, 8), (64, 8)]
    shape_w = [10, 8, 8, 12, 10, 10, 6, 3, 2, 1]
    mean_gpus = sum(p * g * w for (p, g), w in zip(shapes, shape_w, strict=True)) / sum(shape_w)
    mean_duration = 8.0
    rate = load * n_nodes * GPUS / (mean_gpus * mean_duration)  # arrivals per hour for the target load
    jobs, t = [], 0.0
    burst_every = max(50, n_jobs // 4)
    while len(jobs) < n_jobs:
        t += rng.expovariate(rate)
        if len(jobs) % burst_every == burst_every - 1:
            # A burst: several big gangs submitted together (a sweep), more than the free GPUs can hold.
            for _ in range(6):
                jobs.append(Job(len(jobs), t, max(1, n_nodes // 8), GPUS, rng.choices(names, popularity)[0],
                                rng.expovariate(1 / mean_duration)))
            continue
        pods, gpus = rng.choices(shapes, shape_w)[0]
        pods = min(pods, n_nodes // 2)
        jobs.append(Job(len(jobs), t, pods, gpus, rng.choices(names, popularity)[0], rng.expovariate(1 / mean_duration)))
    return nodes, sizes, jobs


class Simulation:
    def __init__(self, policy: str, nodes: list[Node], sizes: dict[str, int], jobs: list[Job], seed: int,
                 locality_wait: float = LOCALITY_WAIT, locality_slack: float = LOCALITY_SLACK,
                 sharded: bool = False, prewarm_tbph: float = 0.0) -> None:
        """``prewarm_tbph``: with ``sharded``, the cache group a pending gang will land in (scheduler_hints.prewarm's
        choice: of the groups whose GPUs could hold it, the one with most free room, then holding most of its
        dataset) is warmed with its dataset at this many TB per hour per group while the gang waits."""
        self.policy, self.sizes = policy, sizes
        self.prewarm_rate = prewarm_tbph * TB if sharded else 0.0
        self.groups: dict[str, ShardedGroup] = {}
        if sharded:  # the warm start's copies become the group's: each leaf holds the most any member held
            for n in nodes:
                g = self.groups.setdefault(n.leaf, ShardedGroup(n.leaf, "", n.leaf, 0))
                g.capacity += n.capacity
            for n in nodes:
                g = self.groups[n.leaf]
                for ds, b in n.cache.items():
                    g.cache[ds] = max(g.cache.get(ds, 0), b)
            self.members = {leaf: sum(n.leaf == leaf for n in nodes) for leaf in self.groups}
            self.leaf_nodes = {leaf: [n for n in nodes if n.leaf == leaf] for leaf in self.groups}
        self.locality_wait, self.locality_slack = locality_wait, locality_slack
        self.nodes = {n.name: n for n in nodes}
        self.jobs = jobs
        self.rng = random.Random(seed)
        self.result = Result(policy)
        self.weights = Weights(topology_levels=("clique", "leaf"))
        self._states: dict[str, NodeState] = {}
        self.version = 0  # bumped whenever GPUs or caches change (keys the deferral's per-dataset scores)
        self._scored: dict[tuple, list] = {}

    # -- node views for the cachefs scorer --------------------------------------------------------------
    def state(self, n: Node) -> NodeState:
        s = self._states.get(n.name)
        if s is None:
            fr = {ds: b / self.sizes[ds] for ds, b in self.held(n).items()}
            view = NodeCacheView(n.name, fr, dict(self.held(n)), n.leaf)
            s = NodeState(n.name, view, {"clique": n.clique, "leaf": n.leaf}, GPUS, n.free)
            self._states[n.name] = s
        elif s.gpu_free != n.free:
            s = replace(s, gpu_free=n.free)
            self._states[n.name] = s
        return s

    def held(self, n: Node) -> dict[str, int]:
        """What node ``n`` holds on its own disk, per dataset."""
        if not self.groups:
            return n.cache
        g = self.groups[n.leaf]
        k = self.members[n.leaf]
        return {ds: b // k for ds, b in g.cache.items()}

    def touch(self, n: Node) -> None:
        self.version += 1
        if self.groups:  # every member's share changed
            self._states = {name: s for name, s in self._states.items() if self.nodes[name].leaf != n.leaf}
        self._states.pop(n.name, None)

    # -- placement --------------------------------------------------------------------------------------
    def pick(self, job: Job, placed: list[str], groups, short: bool = False) -> str | None:
        feasible = [n for n in self.nodes.values() if n.free >= job.gpus]
        if not feasible:
            return None
        if self.policy.startswith("default"):
            best = max(n.free for n in feasible)
            return self.rng.choice([n.name for n in feasible if n.free == best])
        if self.policy == "fluid":
            holders = [n for n in feasible if self.held(n).get(job.dataset)]
            pool = holders or feasible
            best = max(n.free for n in pool)
            return self.rng.choice([n.name for n in pool if n.free == best])
        needs = PodNeeds({job.dataset: self.sizes[job.dataset]}, job.gpus)
        states = [self.state(n) for n in feasible]
        cluster = [self.state(n) for n in self.nodes.values()] if job.pods > 1 and not placed else []
        scores = score_nodes(needs, states, locality_scorer(needs, groups, self.weights), self.weights,
                             gang_size=job.pods if job.pods > 1 else 0,
                             placed=[self.state(self.nodes[p]) for p in placed], cluster=cluster,
                             whole_nodes_short=short)
        top = max(scores)
        return self.rng.choice([s.name for s, score in zip(states, scores, strict=True) if score == top])

    def take(self, job: Job, name: str) -> None:
        self.nodes[name].free -= job.gpus
        self.version += 1
        job.placed.append(name)

    def release(self, job: Job) -> None:
        for name in job.placed:
            self.nodes[name].free += job.gpus
        self.version += 1
        job.placed = []

    def defer(self, job: Job, groups, now: float) -> bool:
        """The extender's delay scheduling: wait (up to ``locality_wait`` since the job first fit) while the
        free slots hold clearly less of the job's data than the best slots would if they were free."""
        if self.locality_wait <= 0:
            return False
        if job.ready_at is None:
            job.ready_at = now
            heapq.heappush(self.events, (now + self.locality_wait, 2, job.id))  # a retry tick when the wait ends
        if now - job.ready_at >= self.locality_wait:
            return False
        key = (job.dataset, job.gpus, self.version)
        scored = self._scored.get(key)
        if scored is None:
            needs = PodNeeds({job.dataset: self.sizes[job.dataset]}, job.gpus)
            score = locality_scorer(needs, groups, self.weights)
            scored = [(score(s), s.gpu_free // job.gpus, s.gpu_allocatable // job.gpus)
                      for s in map(self.state, self.nodes.values())]
            self._scored = {key: scored}
        achievable = best_slots_locality(((loc, free) for loc, free, _ in scored), job.pods)
        possible = best_slots_locality(((loc, cap) for loc, _, cap in scored), job.pods)
        return defer_for_locality(achievable, possible, now - job.ready_at, wait=self.locality_wait,
                                  slack=self.locality_slack)

    def place_whole(self, job: Job, groups, now: float = 0.0) -> bool:
        """Gang admission: place every pod of ``job`` or none."""
        if sum(n.free // job.gpus for n in self.nodes.values()) < job.pods:
            return False
        if self.policy == "cachefs" and self.defer(job, groups, now):
            return False
        short = self.policy == "cachefs" and whole_nodes_short(job.gpus, GPUS, self.waiting_whole(job), self.whole_free())
        for _ in range(job.pods):
            name = self.pick(job, job.placed, groups, short)
            if name is None:  # cannot happen after the admission check, but never leave a partial gang
                self.release(job)
                return False
            self.take(job, name)
        return True

    def waiting_whole(self, job: Job) -> int:
        """What the extender sees from its pod watch: pending pods (other than ``job``'s) that need whole nodes."""
        return sum(q.pods - len(q.placed) for q in self.queue if q.gpus == GPUS and q is not job)

    def whole_free(self) -> int:
        return sum(n.free == GPUS for n in self.nodes.values())

    def account(self, job: Job) -> None:
        size = self.sizes[job.dataset]
        shard = size // job.pods
        if self.groups:
            self.account_sharded(job, size, shard)
            return
        for name in job.placed:
            n = self.nodes[name]
            local = min(shard, int(shard * n.cache.get(job.dataset, 0) / size))
            peers = max((m.cache.get(job.dataset, 0) for m in self.nodes.values()
                         if m.leaf == n.leaf and m.name != name), default=0)
            peer = max(0, min(shard - local, int(shard * peers / size) - local))
            self.result.local_bytes += local
            self.result.peer_bytes += peer
            self.result.origin_bytes += shard - local - peer
            n.add(job.dataset, shard, size)
            self.touch(n)

    def account_sharded(self, job: Job, size: int, shard: int) -> None:
        for name in job.placed:
            n = self.nodes[name]
            g = self.groups[n.leaf]
            from_group = min(shard, int(shard * g.cache.get(job.dataset, 0) / size))
            local = from_group // self.members[n.leaf]
            if job.pods > 1:
                self.result.gang_bytes += shard
                self.result.gang_cached_bytes += from_group
            self.result.local_bytes += local
            self.result.peer_bytes += from_group - local
            self.result.origin_bytes += shard - from_group
            g.add(job.dataset, shard, size)  # its owners fetched what the group lacked, once
            self.touch(n)

    # -- warming where pending gangs will land ---------------------------------------------------------------
    def target_leaf(self, job: Job) -> str | None:
        """The cache group ``job`` (a pending gang) will land in: scheduler_hints.prewarm's choice."""
        best = None
        for leaf, members in self.leaf_nodes.items():
            if len(members) * (GPUS // job.gpus) < job.pods:
                continue
            key = (sum(n.free // job.gpus for n in members),
                   self.groups[leaf].cache.get(job.dataset, 0) / self.sizes[job.dataset], leaf)
            best = max(best, key) if best else key
        return best[2] if best else None

    def prewarm(self, queue: list[Job], t0: float, t1: float) -> None:
        """Between two events, each group warms the datasets of the pending gangs that will land in it, its
        bandwidth shared among them."""
        if t1 <= t0:
            return
        wanted: dict[str, set[str]] = {}
        for q in queue:
            if q.pods > 1 and not q.placed and (leaf := self.target_leaf(q)) is not None:
                wanted.setdefault(leaf, set()).add(q.dataset)
        for leaf, datasets in wanted.items():
            g, each = self.groups[leaf], self.prewarm_rate * (t1 - t0) / len(datasets)
            for ds in sorted(datasets):
                add = int(min(each, self.sizes[ds] - g.cache.get(ds, 0)))
                if add > 0:
                    g.add(ds, add, self.sizes[ds])
                    self.result.prewarm_bytes += add
            self.touch(self.leaf_nodes[leaf][0])

    def run(self) -> Result:
        r = self.result
        events: list[tuple[float, int, int]] = [(j.arrival, 0, j.id) for j in self.jobs]  # (time, kind, job)
        heapq.heapify(events)
        self.events = events
        queue: list[Job] = []
        self.queue = queue
        running = 0
        last_t = 0.0

        def start(q: Job, now: float) -> None:
            nonlocal running
            queue.remove(q)
            running += 1
            r.waits.append(now - q.arrival)
            self.account(q)
            if q.pods > 1:
                r.gangs += 1
                r.multi_leaf += len({self.nodes[n].leaf for n in q.placed}) > 1
            heapq.heappush(events, (now + q.duration, 1, q.id))

        while events:
            t, kind, jid = heapq.heappop(events)
            self.sample_stranded(queue, last_t, t)
            if self.prewarm_rate:
                self.prewarm(queue, last_t, t)
            last_t = t
            job = self.jobs[jid]
            if kind == 0:  # arrival
                queue.append(job)
            elif kind == 1:  # completion (kind 2 is a retry tick: just another scheduling pass)
                running -= 1
                self.release(job)
            groups = group_fractions([self.state(n) for n in self.nodes.values()]) if self.policy == "cachefs" else None
            if self.policy in ("cachefs", "default+gang"):  # gang admission: whole or nothing, in queue order
                for q in list(queue):
                    if self.place_whole(q, groups, t):
                        start(q, t)
                        groups = group_fractions([self.state(n) for n in self.nodes.values()])
            else:  # kube-scheduler without gangs: one pod at a time, pods of queued jobs interleaved
                progress = True
                while progress:
                    progress = False
                    for q in list(queue):
                        name = self.pick(q, q.placed, groups)
                        if name is None:
                            continue
                        self.take(q, name)
                        progress = True
                        if len(q.placed) == q.pods:
                            start(q, t)
            if self.deadlocked(queue):
                # Partial gangs hold GPUs such that none of them could complete even after every running job
                # ends. Count it and break it as a permit timeout would: release the newest partial gang.
                r.deadlocks += 1
                victim = max((q for q in queue if q.placed), key=lambda q: q.arrival)
                self.release(victim)
                heapq.heappush(events, (t + 0.25, 2, victim.id))  # a retry tick
                queue.remove(victim)
                queue.append(victim)
        r.span = last_t
        return r

    def deadlocked(self, queue: list[Job]) -> bool:
        partial = [q for q in queue if q.placed]
        if not partial:
            return False
        total = len(self.nodes) * GPUS
        held = {q.id: len(q.placed) * q.gpus for q in partial}
        all_held = sum(held.values())
        return all((q.pods - len(q.placed)) * q.gpus > total - all_held for q in partial)

    def sample_stranded(self, queue: list[Job], t0: float, t1: float) -> None:
        if t1 <= t0:
            return
        self.result.partial_gpu_hours += sum(len(q.placed) * q.gpus for q in queue) * (t1 - t0)
        # Stranded: free GPUs on partly used nodes while a whole-node job is held up for want of whole free
        # nodes (not while it waits by choice, e.g. for its data, with enough whole nodes free).
        whole = self.whole_free()
        if not any(q.gpus == GPUS and q.pods - len(q.placed) > whole for q in queue):
            return
        stranded = sum(n.free for n in self.nodes.values() if 0 < n.free < GPUS)
        self.result.stranded_area += stranded * (t1 - t0)


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def table(results: list[Result]) -> str:
    head = (f"{'policy':<12} {'local':>7} {'+group':>7} {'origin TB':>10} {'peer TB':>8} {'wait mean h':>12} {'wait p95 h':>11} "
            f"{'deadlocks':>10} {'idle partial GPU-h':>19} {'stranded GPUs':>14} {'multi-leaf gangs':>17}")
    lines = [head, "-" * len(head)]
    for r in results:
        stranded = r.stranded_area / r.span if r.span else 0.0
        lines.append(f"{r.policy:<12} {r.local_fraction:>7.3f} {r.group_fraction:>7.3f} "
                     f"{r.origin_bytes / TB:>10.1f} {r.peer_bytes / TB:>8.1f} "
                     f"{statistics.fmean(r.waits) if r.waits else 0:>12.2f} {pct(r.waits, 0.95):>11.2f} "
                     f"{r.deadlocks:>10} {r.partial_gpu_hours:>19.0f} {stranded:>14.1f} "
                     f"{f'{r.multi_leaf}/{r.gangs}':>17}")
    return "\n".join(lines)


def report(results: list[Result]) -> tuple[float, float, float, int]:
    """Print the target lines; returns (local vs default, local vs fluid, stranded ours − default, deadlocks)."""
    by = {r.policy: r for r in results}
    a, ag, b, c = by["default"], by["default+gang"], by["fluid"], by["cachefs"]
    vs_a = c.local_fraction / max(a.local_fraction, 1e-9)
    vs_b = c.local_fraction / max(b.local_fraction, 1e-9)
    print(f"local fraction: cachefs/default = {vs_a:.2f}× (target ≥ 1.5), cachefs/fluid = {vs_b:.3f}× (target ≥ 1.0)")
    ga = c.group_fraction / max(a.group_fraction, 1e-9)
    gb = c.group_fraction / max(b.group_fraction, 1e-9)
    print(f"node-or-group fraction: cachefs/default = {ga:.2f}×, cachefs/fluid = {gb:.3f}×")
    frag = [r.stranded_area / r.span if r.span else 0.0 for r in (a, ag, c)]
    print(f"stranded GPUs: cachefs {frag[2]:.1f} vs default {frag[0]:.1f} / default+gang {frag[1]:.1f}; "
          f"deadlocks: cachefs {c.deadlocks}, default {a.deadlocks}, fluid {b.deadlocks}")
    return vs_a, vs_b, frag[2] - frag[0], c.deadlocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=1500)
    ap.add_argument("--seeds", default="7", help="comma-separated seeds; one table each, then a summary")
    ap.add_argument("--locality-wait", type=float, default=LOCALITY_WAIT, help="hours (0: no delay scheduling)")
    ap.add_argument("--sharded", action="store_true", help="leaves are cache groups sharding each dataset")
    ap.add_argument("--prewarm-tbph", type=float, default=0.0, metavar="TB_PER_HOUR",
                    help="with --sharded: also run cachefs warming the group a pending gang will land in at this rate "
                         "per group (4.5 TB/h is 10 Gbit/s), and compare its gangs' first epochs")
    args = ap.parse_args()
    rows = []
    for seed in (int(x) for x in args.seeds.split(",")):
        results = [Simulation(p, *make_world(args.nodes, args.jobs, seed), seed=seed,
                              locality_wait=args.locality_wait, sharded=args.sharded).run() for p in POLICIES]
        caches = "leaves are sharded cache groups" if args.sharded else "each node caches alone"
        print(f"placement simulation: {args.nodes} nodes × {GPUS} GPUs, {args.jobs} jobs, seed {seed}; {caches}")
        print(table(results))
        rows.append((seed, *report(results)))
        if args.sharded and args.prewarm_tbph > 0:
            warmed = Simulation("cachefs", *make_world(args.nodes, args.jobs, seed), seed=seed,
                                locality_wait=args.locality_wait, sharded=True, prewarm_tbph=args.prewarm_tbph).run()
            plain = next(r for r in results if r.policy == "cachefs")
            print(f"warming where pending gangs land ({args.prewarm_tbph:g} TB/h per group), same trace: gangs' first "
                  f"epoch from node or group {plain.gang_cached_bytes / max(plain.gang_bytes, 1):.3f} without, "
                  f"{warmed.gang_cached_bytes / max(warmed.gang_bytes, 1):.3f} with; object storage read "
                  f"{plain.origin_bytes / TB:.0f} TB without, {warmed.origin_bytes / TB:.0f} TB + "
                  f"{warmed.prewarm_bytes / TB:.0f} TB ahead with; mean wait {statistics.fmean(plain.waits):.2f} h "
                  f"vs {statistics.fmean(warmed.waits):.2f} h")
        print(flush=True)
    if len(rows) > 1:
        print("seed  local/default  local/fluid  stranded ours−default  deadlocks")
        for seed, vs_a, vs_b, frag, dead in rows:
            print(f"{seed:>4}  {vs_a:>13.2f}  {vs_b:>11.3f}  {frag:>+21.1f}  {dead:>9}")
        print(f"mean  {statistics.fmean(r[1] for r in rows):>13.2f}  {statistics.fmean(r[2] for r in rows):>11.3f}  "
              f"{statistics.fmean(r[3] for r in rows):>+21.1f}")


if __name__ == "__main__":
    main()

"""Why eviction is "two-touch LRU": byte hit ratios of the engine's policies (cachefs.node.eviction_policy, run here
as the engine runs them) against FIFO and random eviction, with the engine's watermark rule (evict from high to
low watermark), on access traces typical of a training node.

- ``zipf``: several jobs share a node and read a catalogue with skewed popularity (s = 1.1);
- ``hot+scan``: a hot working set re-read all the time, interrupted by one-off scans of cold data;
- ``epochs``: one job reads a dataset 20 % larger than the cache, shuffled, epoch after epoch.

All seeded; printed as a table with LRU's ratio to the best alternative.

    python -m bench.eviction_bench
"""

from __future__ import annotations

import random

from cachefs.index.records import ObjectRecord
from cachefs.node.eviction_policy import Candidate, EvictionHints, policy_named

HIGH, LOW = 0.95, 0.85


def simulate(policy: str, trace: list[int], size: dict[int, int], capacity: int, seed: int = 0) -> float:
    """Byte hit ratio of ``policy`` over ``trace``: a name in cachefs.node.eviction_policy.POLICIES (the engine's
    own policy objects order the victims), or the baselines ``fifo`` and ``random``."""
    rng = random.Random(seed)
    last: dict[int, int] = {}
    touches: dict[int, int] = {}
    inserted: dict[int, int] = {}
    used = hits = total = 0
    for t, obj in enumerate(trace):
        total += size[obj]
        if obj in last:
            hits += size[obj]
            last[obj] = t
            touches[obj] += 1
            continue
        last[obj], touches[obj], inserted[obj] = t, 1, t
        used += size[obj]
        if used > HIGH * capacity:
            if policy == "random":
                order = list(last)
                rng.shuffle(order)
            elif policy == "fifo":
                order = sorted(last, key=inserted.__getitem__)
            else:
                candidates = [Candidate(o.to_bytes(16, "big"), ObjectRecord("ds", "", "", size[o], size[o], last[o],
                                                                          touches[o])) for o in last]
                order = [int.from_bytes(c.key, "big")
                         for c in policy_named(policy).order(candidates, EvictionHints())]
            for victim in order:
                if used <= LOW * capacity:
                    break
                used -= size[victim]
                del last[victim], touches[victim], inserted[victim]
    return hits / total


def traces(seed: int = 1) -> dict[str, tuple[list[int], dict[int, int], int]]:
    rng = random.Random(seed)
    n = 5000
    size = {i: rng.randint(64 << 10, 4 << 20) for i in range(n)}
    total = sum(size.values())
    weights = [1 / (i + 1) ** 1.1 for i in range(n)]
    zipf = rng.choices(range(n), weights=weights, k=60_000)
    hot = list(range(400))
    hot_scan: list[int] = []
    for _ in range(40):
        hot_scan += rng.choices(hot, k=1500)
        start = rng.randrange(400, n - 500)
        hot_scan += list(range(start, start + 500))
    epochs: list[int] = []
    for _ in range(5):
        order = list(range(n))
        rng.shuffle(order)
        epochs += order
    return {
        "zipf": (zipf, size, total // 5),
        "hot+scan": (hot_scan, size, sum(size[i] for i in hot) * 2),
        "epochs": (epochs, size, int(total / 1.2)),
    }


def main() -> None:
    print("| trace | two-touch LRU (ours) | LRU | FIFO | random | ours vs best other |\n|---|---|---|---|---|---|")
    for name, (trace, size, cap) in traces().items():
        r = {p: simulate(p, trace, size, cap) for p in ("two-touch-lru", "lru", "fifo", "random")}
        best = max(r["lru"], r["fifo"], r["random"])
        print(f"| {name} | {r['two-touch-lru']:.3f} | {r['lru']:.3f} | {r['fifo']:.3f} | {r['random']:.3f} | "
              f"{r['two-touch-lru'] / best if best else float('inf'):.2f}× |")


if __name__ == "__main__":
    main()

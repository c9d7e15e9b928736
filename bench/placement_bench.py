"""Cache-group placement at scale: how long the HRW slot table takes to build for N members, what one member
joining or leaving costs and moves, and owner lookups per second (docs/CLUSTER.md).

    python -m bench.placement_bench [--members 5000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cachefs.cluster.placement import SLOTS, Placement, Weighted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=5000)
    ap.add_argument("--lookups", type=int, default=200_000)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    members = [Weighted(f"node-{i:05d}", float(w)) for i, w in enumerate(rng.choice([3.84, 7.68, 15.36], args.members))]
    t = time.perf_counter()
    p = Placement(members)
    build = time.perf_counter() - t
    t = time.perf_counter()
    joined = p.joined(Weighted("node-new", 7.68))
    join = time.perf_counter() - t
    t = time.perf_counter()
    left = p.left(members[17].name)
    leave = time.perf_counter() - t
    def owner_names(placement):
        return np.array(placement.names, dtype=object)[placement.slot_owners()]

    before, after_join, after_leave = owner_names(p), owner_names(joined), owner_names(left)
    moved_join = float(np.mean(before != after_join))
    moved_leave = float(np.mean(before != after_leave))
    keys = [f"ds/obj-{i}/etag/{i % 97}".encode() for i in range(args.lookups)]
    t = time.perf_counter()
    for k in keys:
        p.owner(k)
    lookup = (time.perf_counter() - t) / len(keys)
    total_w = sum(m.weight for m in members)
    shares = np.bincount(p.slot_owners(), minlength=len(members)) / SLOTS
    ideal = np.array([m.weight for m in members]) / total_w
    classes = sorted({m.weight for m in members})
    by_class = {w: (shares[[m.weight == w for m in members]].sum(), ideal[[m.weight == w for m in members]].sum())
                for w in classes}
    print(f"members {args.members}, slots {SLOTS}")
    print(f"  table build            {build * 1e3:8.1f} ms (once per membership change from scratch)")
    print(f"  one member joins       {join * 1e3:8.1f} ms, moves {moved_join:.4%} of slots (ideal 1/(N+1) = "
          f"{1 / (args.members + 1):.4%})")
    print(f"  one member leaves      {leave * 1e3:8.1f} ms, moves {moved_leave:.4%} of slots (its own share "
          f"{p.owned_share(members[17].name):.4%})")
    print(f"  owner lookup           {lookup * 1e6:8.2f} us ({1 / lookup / 1e6:.2f} M lookups/s, one core)")
    for w, (got, want) in by_class.items():
        print(f"  capacity {w:5.2f} TB class  owns {got:7.2%} of slots (its weight: {want:7.2%})")
    rel = shares / ideal
    print(f"  one member's share     p5 {np.percentile(rel, 5):.2f}x, median {np.median(rel):.2f}x, p95 "
          f"{np.percentile(rel, 95):.2f}x its weight ({SLOTS / len(members):.0f} slots per member on average)")


if __name__ == "__main__":
    main()

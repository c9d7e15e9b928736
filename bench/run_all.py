"""Run every benchmark in bench/ with its default (issue-sized) parameters."""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = ["bench.read_bench", "bench.warm_read_bench", "bench.manifest_bench", "bench.eviction_bench", "bench.memory_bench",
              "bench.fuse_bench", "bench.full_disk_bench", "bench.small_files_bench", "bench.pack_bench",
              "bench.extender_bench", "bench.placement_sim", "bench.placement_bench", "bench.cluster_bench",
              "bench.epoch_bench", "bench.loaders_bench", "bench.checkpoint_bench", "bench.placement_dra"]

if __name__ == "__main__":
    for mod in BENCHMARKS:
        print(f"## {mod}", flush=True)
        subprocess.run([sys.executable, "-m", mod, *sys.argv[1:]], check=True)

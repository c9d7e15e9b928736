"""A process that embeds cachefs with a node-wide metrics directory exits without a traceback, even when it dropped
PROMETHEUS_MULTIPROC_DIR from its environment meanwhile (bench/group_chaos.py's harness did)."""

from __future__ import annotations

import subprocess
import sys


def test_exit_after_the_metrics_directory_left_the_environment(tmp_path):
    code = (f"import os; os.environ['PROMETHEUS_MULTIPROC_DIR'] = {str(tmp_path)!r}; import cachefs.base.metrics; "
            "del os.environ['PROMETHEUS_MULTIPROC_DIR']")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr

from __future__ import annotations

import subprocess
import sys

# In a child process: the settings are process-wide, and the test runner's own must stay as they are.
_PROBE = """
import gc, weakref
from cachefs.base.collector import YOUNG_THRESHOLD, quiet_collector
before = gc.get_threshold()
quiet_collector()
assert gc.get_freeze_count() > 0, "nothing set aside"
assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2]), gc.get_threshold()
class Node: pass
a, b = Node(), Node()
a.peer, b.peer = b, a
gone = weakref.ref(a)
del a, b
gc.collect()
assert gone() is None, "a cycle made after the freeze was not collected"
print("ok")
"""


def test_quiet_collector_sets_old_objects_aside_and_still_collects_cycles():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_cli_quiets_the_collector_before_running_a_command(tmp_path):
    probe = ("import gc, sys\nfrom cachefs.cli import main as m\n"
             "sys.argv = ['cachefs', 'status', '--json', '--cache-dir', sys.argv[1]]\n"
             "try:\n    m.main(sys.argv[1:])\nfinally:\n    print('THRESHOLD', gc.get_threshold()[0], file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "cache")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "THRESHOLD 20000" in out.stderr, out.stderr

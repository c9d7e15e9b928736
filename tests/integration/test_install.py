"""How cachefs is installed: a directory named ``cachefs`` in the working directory (the name a clone gets) does not
shadow the installed package (the src layout: an editable install puts src/ on sys.path)."""

from __future__ import annotations

import subprocess
import sys


def test_a_directory_named_cachefs_in_the_working_directory_does_not_shadow_the_package(tmp_path):
    clone = tmp_path / "cachefs"
    (clone / "docs").mkdir(parents=True)  # (a clone's root: no __init__.py, so only a namespace portion)
    r = subprocess.run([sys.executable, "-c", "import cachefs; print(cachefs.__file__); print(cachefs.publish_order)"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].endswith("cachefs/__init__.py") and "function publish_order" in r.stdout

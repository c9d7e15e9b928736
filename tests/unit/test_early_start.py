"""A child started before it is needed (cachefs.base.early_start): it waits until told to go, with what the parent
learnt meanwhile added to its environment (an adopted mount's credentials), or leaves when cancelled."""

from __future__ import annotations

import subprocess
import sys

CHILD = ("import os, sys; from cachefs.base.early_start import wait_for_go; went = wait_for_go(); "
         "print(went, os.environ.get('AWS_ACCESS_KEY_ID', '-'), flush=True)")


def test_the_child_goes_on_with_what_the_parent_adds_to_its_environment():
    out = subprocess.run([sys.executable, "-c", (
        "import sys; from cachefs.base.early_start import EarlyChild; "
        f"c = EarlyChild([sys.executable, '-c', {CHILD!r}]); "
        "c.go({'AWS_ACCESS_KEY_ID': 'AKIDADOPTED'}).wait(30)")], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "AKIDADOPTED"], out


def test_the_child_goes_on_unchanged_without_anything_added_and_leaves_when_cancelled():
    out = subprocess.run([sys.executable, "-c", (
        "import sys; from cachefs.base.early_start import EarlyChild; "
        f"c = EarlyChild([sys.executable, '-c', {CHILD!r}]); c.go().wait(30); "
        f"d = EarlyChild([sys.executable, '-c', {CHILD!r}]); d.cancel()")], capture_output=True, text=True,
        timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.split() == ["True", "-", "False", "-"], out

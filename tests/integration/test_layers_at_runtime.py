"""Who calls whom at run time. import-linter checks imports; this checks calls, which an injected callable or
an object handed down could carry back up: a workload (a packed mirror, cold and warm reads of large and small
files, eviction on a small cache) runs under a profiler, and every call from a cachefs module into one of a
higher layer (the layers of the import-linter contract in pyproject.toml) must be a call of a function the caller
was handed for that very call (a write to run when there is room, a transaction body)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import fsspec

from tests.conftest import put_tree

ROOT = Path(__file__).resolve().parents[2]


def _ranks() -> dict[str, int]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "cachefs-layers")["layers"]
    return {m.strip(): rank for rank, layer in enumerate(reversed(layers)) for m in layer.replace(":", "|").split("|")}


def _layer(module: str, ranks: dict[str, int]) -> int | None:
    parts = module.split(".")
    while parts:
        rank = ranks.get(".".join(parts))
        if rank is not None:
            return rank
        parts.pop()
    return None


def _handed_in(frame, code) -> bool:
    """Whether ``code`` is that of a callable passed to ``frame``'s function as an argument (a function, a bound
    method, or a functools.partial of either: work handed to a service, as to the prefetcher)."""
    co = frame.f_code
    names = co.co_varnames[:co.co_argcount + co.co_kwonlyargcount]
    for name in names:
        value = frame.f_locals.get(name)
        while isinstance(value, functools.partial):
            value = value.func
        if getattr(value, "__code__", None) is code or getattr(getattr(value, "__func__", None), "__code__", None) is code:
            return True
    return False


def test_no_call_runs_up_the_layers_except_into_what_the_caller_handed_down(s3, tmp_path):
    _, client, bucket = s3
    files = {"big.bin": os.urandom(3_000_000)} | {f"d/{i:03d}.txt": os.urandom(3000) for i in range(80)}
    put_tree(client, bucket, "rt", files)
    url = f"s3://{bucket}/rt"
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "pack", url, "--cache-dir", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ranks = _ranks()
    upward: dict[tuple[str, str, str, str], int] = {}
    calls = [0]

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        caller_frame = frame.f_back
        if caller_frame is None or not callee.startswith("cachefs."):
            return
        caller = caller_frame.f_globals.get("__name__", "")
        if not caller.startswith("cachefs."):
            return
        calls[0] += 1
        lo, hi = _layer(caller, ranks), _layer(callee, ranks)
        if lo is not None and hi is not None and hi > lo and not _handed_in(caller_frame, frame.f_code):
            key = (caller, caller_frame.f_code.co_name, callee, frame.f_code.co_name)
            upward[key] = upward.get(key, 0) + 1

    def everywhere(hook) -> None:  # this thread, threads started from now on, and the running event loop's
        from cachefs.base import aio

        threading.setprofile(hook)
        sys.setprofile(hook)
        done = threading.Event()
        aio.get_loop().call_soon_threadsafe(lambda: (sys.setprofile(hook), done.set()))
        assert done.wait(10)

    everywhere(profile)
    try:
        fs = fsspec.filesystem("cachefs", target_protocol="s3", cache_dir=str(tmp_path / "c"), dataset=url,
                               skip_instance_cache=True, cache_block_size=65536, cache_capacity="2MB",
                               cache_min_free="0")
        for _ in range(2):
            for rel, data in files.items():
                with fs.open(f"{bucket}/rt/{rel}", "rb") as f:
                    assert b"".join(iter(lambda f=f: f.read(100_000), b"")) == data
        fs.engine.flush_stats()
    finally:
        everywhere(None)
    assert calls[0] > 10_000  # the hook saw the workload
    assert upward == {}

"""The session's Kubernetes control plane (built once per run from Go modules, reused across tests) and the
cachefs scheduler extender running against it."""

from __future__ import annotations

import pytest

from .controlplane import REPO, start_control_plane


@pytest.fixture(scope="session")
def k8s():
    cp = start_control_plane()
    try:
        cp.apply_file(REPO / "deploy" / "base" / "namespace.yaml")
        for name in ("rbac-node-agent.yaml", "node-agent-own-node.yaml", "rbac-scheduler-extender.yaml"):
            cp.apply_file(REPO / "deploy" / "base" / name)
        cp.start_extender()
        yield cp
    finally:
        cp.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on the control plane carries the tail of the extender's and kube-scheduler's logs (CI keeps
    nothing else of the run)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    cp = next((v for v in getattr(item, "funcargs", {}).values() if hasattr(v, "procs")), None)
    for name in ("extender", "kube-scheduler"):
        proc = cp.procs.get(name) if cp is not None else None
        if proc is not None and proc.log.exists():
            report.sections.append((f"{name} log (last 40 lines)",
                                    "\n".join(proc.log.read_text(errors="replace").splitlines()[-40:])))

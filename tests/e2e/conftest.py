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

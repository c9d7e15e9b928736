"""A test run leaves nothing of the control plane on disk: etcd data, the service-account key, tokens."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .controlplane import ControlPlane


def test_stopping_the_control_plane_removes_its_work_directory_even_after_a_failed_start(tmp_path):
    workdir = Path(tempfile.mkdtemp(prefix="cachefs-k8s-"))
    (workdir / "sa.key").write_text("secret")
    (workdir / "tokens.csv").write_text("token,admin,admin")
    cp = ControlPlane(tmp_path / "no-binaries-here", workdir)
    try:
        cp.start()  # fails: there is nothing to run
    except Exception:  # noqa: BLE001 - whatever the failure, the files must go
        pass
    finally:
        cp.stop()
    assert not workdir.exists()

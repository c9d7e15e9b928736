"""The node plugin's registration with kubelet (csi/registration.py), spoken to as kubelet's plugin watcher does: over
the socket in the registration directory, GetInfo then NotifyRegistrationStatus; the socket is root's alone and goes
away when the plugin stops (kubelet then unregisters the driver). tests/node runs it against a real kubelet."""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from csi.gen import pluginregistration_pb2 as pb
from csi.gen import pluginregistration_pb2_grpc as rpc
from csi.registration import Registration, registration_socket


def test_kubelet_learns_the_driver_and_the_socket_it_should_use_and_the_outcome_is_kept(tmp_path):
    reg = Registration(str(tmp_path / "plugins_registry"), "csi.cachefs.io",
                       "/var/lib/kubelet/plugins/csi.cachefs.io/csi.sock")
    reg.start()
    try:
        path = registration_socket(str(tmp_path / "plugins_registry"), "csi.cachefs.io")
        assert path.endswith("/csi.cachefs.io-reg.sock")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with grpc.insecure_channel(f"unix://{path}") as channel:
            stub = rpc.RegistrationStub(channel)
            info = stub.GetInfo(pb.InfoRequest(), timeout=10)
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
                "CSIPlugin", "csi.cachefs.io", "/var/lib/kubelet/plugins/csi.cachefs.io/csi.sock", ["1.0.0"])
            assert reg.status == (None, "")
            stub.NotifyRegistrationStatus(pb.RegistrationStatus(plugin_registered=False, error="version"), timeout=10)
            assert reg.notified.is_set() and reg.status == (False, "version")
            stub.NotifyRegistrationStatus(pb.RegistrationStatus(plugin_registered=True), timeout=10)
            assert reg.status == (True, "")
    finally:
        reg.stop()
    assert not os.path.exists(path)


def test_a_relative_kubelet_path_is_refused():
    with pytest.raises(ValueError, match="absolute"):
        Registration("/tmp", "csi.cachefs.io", "plugins/csi.sock")

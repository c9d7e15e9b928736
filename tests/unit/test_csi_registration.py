"""The node plugin's registration with kubelet (csi/registration.py), spoken to as kubelet's plugin watcher does: over
the socket in the registration directory, GetInfo then NotifyRegistrationStatus; the socket is root's alone and goes
away when the plugin stops (kubelet then unregisters the driver). tests/node runs it against a real kubelet."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import grpc
import pytest

from cachefs.base.errors import ConfigError
from csi.gen import pluginregistration_pb2 as pb
from csi.gen import pluginregistration_pb2_grpc as rpc
from csi.registration import Registration, registration_socket


@pytest.fixture
def short_dir():
    """A directory with a short path (pytest's may be longer than a unix socket's path may be)."""
    d = tempfile.mkdtemp(prefix="cfs-reg-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_kubelet_learns_the_driver_and_the_socket_it_should_use_and_the_outcome_is_kept(short_dir):
    reg = Registration(os.path.join(short_dir, "plugins_registry"), "csi.cachefs.io",
                       "/var/lib/kubelet/plugins/csi.cachefs.io/csi.sock")
    reg.start()
    try:
        path = registration_socket(os.path.join(short_dir, "plugins_registry"), "csi.cachefs.io")
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


def test_a_registration_directory_too_long_for_a_socket_is_a_clear_error(tmp_path):
    reg = Registration(str(tmp_path / ("x" * 120)), "csi.cachefs.io", "/var/lib/kubelet/plugins/x/csi.sock")
    with pytest.raises(ConfigError, match="longer than"):
        reg.start()


def test_a_relative_kubelet_path_is_refused():
    with pytest.raises(ValueError, match="absolute"):
        Registration("/tmp", "csi.cachefs.io", "plugins/csi.sock")

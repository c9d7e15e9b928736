"""The mounter's socket protocol: what it accepts, what it refuses and how, and how the client reports a
mounter that is down. (Real mounts through it are in tests/e2e/test_csi.py.)"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading

import pytest

from cachefs.base.errors import CacheFSError
from csi.mounter import MounterUnavailable, RemoteMounter, parse_request, serve_mounter


def test_parse_request_accepts_a_mount_under_the_root_and_a_ping(tmp_path):
    root = str(tmp_path)
    req = parse_request(json.dumps({"op": "mount", "url": "s3://b/p", "mountpoint": f"{root}/k/mnt",
                                    "region": "r", "env": {"AWS_ACCESS_KEY_ID": "x"}}).encode(), root)
    assert (req.url, req.mountpoint, req.region, req.env) == ("s3://b/p", f"{root}/k/mnt", "r",
                                                              {"AWS_ACCESS_KEY_ID": "x"})
    assert "AWS_ACCESS_KEY_ID" not in repr(req)  # credentials stay out of logs
    assert parse_request(b'{"op": "ping"}', root) is None
    spec = "torch-distributed:seed=3,world-size=4,ranks=2"
    req = parse_request(json.dumps({"op": "mount", "url": "s3://b/p", "mountpoint": f"{root}/m",
                                    "sampler": spec}).encode(), root)
    assert req.sampler == spec


def test_a_volumes_sampler_attribute_is_checked_and_part_of_what_the_volume_is():
    from csi.volume import DatasetVolume, VolumeError

    vol = DatasetVolume.from_attributes({"url": "s3://b/p", "sampler": "torch-distributed:world-size=8,ranks=0-7"})
    assert DatasetVolume.from_volume_id(vol.volume_id).sampler == "torch-distributed:world-size=8,ranks=0-7"
    other = DatasetVolume.from_attributes({"url": "s3://b/p", "sampler": "torch-distributed:world-size=8,ranks=1"})
    assert other.session_key != vol.session_key  # two ranks' pods on one node: two mounts, each its own orders
    with pytest.raises(VolumeError, match=r"volume attribute 'sampler'.*below world-size"):
        DatasetVolume.from_attributes({"url": "s3://b/p", "sampler": "torch-distributed:world-size=2,ranks=3"})


def test_a_writable_volume_is_its_own_volume_and_session_and_checks_its_attributes(tmp_path):
    from csi.volume import DatasetVolume, VolumeError

    vol = DatasetVolume.from_attributes({"url": "s3://b/ckpt", "writable": "true"})
    assert vol.writable and DatasetVolume.from_volume_id(vol.volume_id).writable
    assert vol.session_key != DatasetVolume.from_attributes({"url": "s3://b/ckpt"}).session_key
    for attrs, why in (({"url": "s3://b/c", "writable": "yes"}, '"true" or "false"'),
                       ({"url": "file:///data", "writable": "true"}, "S3"),
                       ({"url": "s3://b/c", "writable": "true", "mode": "0440"}, "read-only datasets")):
        with pytest.raises(VolumeError, match=why):
            DatasetVolume.from_attributes(attrs)
    req = parse_request(json.dumps({"op": "mount", "url": "s3://b/c", "mountpoint": f"{tmp_path}/m",
                                    "writable": True}).encode(), str(tmp_path))
    assert req.writable


@pytest.mark.parametrize("msg, why", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"op": "umount"}', "unknown op"),
    (b'{"op": "mount", "url": "s3://b"}', "required"),
    (b'{"op": "mount", "url": 5, "mountpoint": "/x"}', "strings"),
    (b'{"op": "mount", "url": "s3://b", "mountpoint": "/etc"}', "outside"),
    (b'{"op": "mount", "url": "s3://b", "mountpoint": "ROOT/../escape"}', "outside"),
    (b'{"op": "mount", "url": "s3://b", "mountpoint": "ROOT"}', "outside"),
    (b'{"op": "mount", "url": "s3://b", "mountpoint": "ROOT/m", "env": {"A": 1}}', "env"),
    (b'{"op": "mount", "url": "s3://b", "mountpoint": "ROOT/m", "sampler": "random"}', "known samplers"),
    (b'{"op": "mount", "url": "s3://b", "mountpoint": "ROOT/m", "sampler": 7}', "strings"),
    (b'{"op": "mount", "url": "s3://b", "mountpoint": "ROOT/m", "writable": "yes"}', "writable"),
])
def test_parse_request_refuses_bad_requests_clearly(tmp_path, msg, why):
    with pytest.raises(ValueError, match=why):
        parse_request(msg.replace(b"ROOT", str(tmp_path).encode()), str(tmp_path))


@pytest.fixture
def server(tmp_path):
    sock, stop, ready = str(tmp_path / "run" / "mounter.sock"), threading.Event(), threading.Event()
    t = threading.Thread(target=serve_mounter, args=(sock, str(tmp_path / "sessions"), str(tmp_path / "cache")),
                         kwargs={"ready": ready, "stop": stop}, daemon=True)
    t.start()
    assert ready.wait(10)
    yield sock
    stop.set()
    t.join(10)
    assert not t.is_alive()


def _raw(sock: str, data: bytes) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(sock)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return json.loads(s.makefile("rb").readline())


def test_server_answers_ping_and_refuses_bad_requests_without_dying(server, tmp_path):
    assert stat.S_IMODE(os.stat(server).st_mode) == 0o600  # root only: requests carry credentials
    client = RemoteMounter(server)
    assert client.healthy() == (True, "")
    assert "unknown op" in _raw(server, b'{"op": "format"}\n')["error"]
    assert "one line" in _raw(server, b'{"op": "ping"}')["error"]  # no newline: refused, not waited on forever
    with pytest.raises(CacheFSError, match="outside"):
        client._call({"op": "mount", "url": "file:///x", "mountpoint": "/etc"}, timeout=10)
    with pytest.raises(CacheFSError, match=r"mount point .* does not exist"):  # a mount that fails, and why
        client._call({"op": "mount", "url": "file:///nonexistent-dataset", "mountpoint":
                      str(tmp_path / "sessions" / "k" / "mnt")}, timeout=60)
    (tmp_path / "sessions" / "k" / "mnt").mkdir(parents=True)
    with pytest.raises(CacheFSError, match=r"file:///nonexistent-dataset.*not found"):
        client._call({"op": "mount", "url": "file:///nonexistent-dataset", "mountpoint":
                      str(tmp_path / "sessions" / "k" / "mnt")}, timeout=60)
    assert client.healthy() == (True, "")  # still serving


def test_client_reports_a_mounter_that_is_down(tmp_path):
    client = RemoteMounter(str(tmp_path / "none.sock"))
    ok, why = client.healthy()
    assert not ok and "mounter is not running" in why
    with pytest.raises(MounterUnavailable, match="mounter container"):
        from csi.mounter import MountRequest

        client.mount(MountRequest("file:///x", str(tmp_path / "m")))

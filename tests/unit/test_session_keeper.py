"""The session keeper's socket (cachefs/fuse/keeper.py): what it keeps, what it hands back, and bad requests answered
with a clear error (never a traceback or a dropped connection). tests/e2e/test_csi.py kills a mounter's container
with real FUSE sessions under it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile

import pytest

from cachefs.base.errors import CacheFSError
from cachefs.fuse.keeper import SessionKeeper, drop_session, has_session, keep_session, kept_sessions, take_session


@pytest.fixture
def keeper():
    d = tempfile.mkdtemp(prefix="cfs-keeper-")  # (pytest's tmp_path can be longer than a socket's path may be)
    k = SessionKeeper(os.path.join(d, "keeper.sock"))
    k.start()
    yield k
    k.stop()
    shutil.rmtree(d, ignore_errors=True)


def test_a_kept_descriptor_is_handed_back_as_a_copy_with_its_meta_and_credentials_only(keeper):
    assert stat.S_IMODE(os.stat(keeper.path).st_mode) == 0o600
    r, w = os.pipe()  # any descriptor stands in for /dev/fuse here
    keep_session(keeper.path, "/mnt/a", w, {"argv": ["cachefs", "mount"], "pid": 42, "generation": 3},
                 {"AWS_SECRET_ACCESS_KEY": "s", "HOME": "/root"})
    os.close(w)
    assert kept_sessions(keeper.path) == {"/mnt/a": {"argv": ["cachefs", "mount"], "pid": 42, "generation": 3}}
    assert has_session(keeper.path, "/mnt/a", 42) and not has_session(keeper.path, "/mnt/a", 43)
    fd, meta, env = take_session(keeper.path, "/mnt/a")
    assert meta["generation"] == 3 and env == {"AWS_SECRET_ACCESS_KEY": "s"}  # nothing but credentials kept
    os.write(fd, b"x")  # the copy is the same pipe
    os.close(fd)
    assert os.read(r, 1) == b"x"
    fd, _, _ = take_session(keeper.path, "/mnt/a")  # still kept after a take
    os.close(fd)
    drop_session(keeper.path, "/mnt/a")
    assert kept_sessions(keeper.path) == {}
    os.close(r)


@pytest.mark.parametrize("request_line, message", [
    (b"not json\n", "JSON"), (b'["keep"]\n', "JSON object"), (b'{"op": "fly"}\n', "unknown op"),
    (b'{"op": "take", "mountpoint": "relative"}\n', "absolute"), (b'{"op": "keep", "mountpoint": "/m"}\n', "descriptor"),
    (b'{"op": "take", "mountpoint": "/nothing"}\n', "no session"),
])
def test_bad_requests_get_an_error_line(keeper, request_line, message):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(keeper.path)
        s.sendall(request_line)
        reply = json.loads(s.makefile("rb").readline())
    assert message in reply["error"]


def test_no_keeper_is_a_clear_error(tmp_path):
    with pytest.raises(CacheFSError, match="session keeper at"):
        kept_sessions(str(tmp_path / "none.sock"))

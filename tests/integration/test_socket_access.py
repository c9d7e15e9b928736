"""Every unix socket cachefs listens on is root's alone: the CSI plugin's (kubelet calls it), the mounter's
(its requests carry credentials) and a mount's hand-over socket (it hands out the FUSE descriptor, the whole file
system). Another user on the node is refused by the kernel at connect(). The sockets are made in a directory
anyone may enter, so that it is each socket's own mode that is tested."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from cachefs.base.sockets import socket_path_for
from cachefs.index.mounts import mount_file
from tests.conftest import put_tree
from tests.integration.test_fuse import Mounted

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, another uid)")


def connect_as(uid: int, path: str) -> str:
    code = ("import os, socket, sys\nos.setgid({0}); os.setuid({0})\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1]); print('connected')\nexcept OSError as e:\n    print(type(e).__name__)")
    return subprocess.run([sys.executable, "-c", code.format(uid), path], capture_output=True, text=True,
                          timeout=30).stdout.strip()


@pytest.fixture
def open_dir():
    d = tempfile.mkdtemp(prefix="cachefs-sockets-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_check_can_fail(open_dir):
    """A socket anyone may write to is reached by nobody: what the tests below see is the socket's mode."""
    path = os.path.join(open_dir, "open.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        os.chmod(path, 0o666)
        s.listen()
        assert connect_as(NOBODY, path) == "connected"


def test_csi_mounter_keeper_and_registration_sockets_refuse_other_users(open_dir):
    from csi.mounter import serve_mounter
    from csi.server import serve

    stop, csi_ready, mounter_ready = threading.Event(), threading.Event(), threading.Event()
    csi_sock, mounter_sock = os.path.join(open_dir, "csi.sock"), os.path.join(open_dir, "mounter.sock")
    keeper_sock, registry = os.path.join(open_dir, "keeper.sock"), os.path.join(open_dir, "plugins_registry")
    cache, state = os.path.join(open_dir, "cache"), os.path.join(open_dir, "state")
    threads = [threading.Thread(target=serve, args=(f"unix://{csi_sock}",), daemon=True,
                                kwargs=dict(node_id="n1", cache_dir=cache, state_dir=state, ready=csi_ready,
                                            stop=stop, session_keeper=keeper_sock, registration_dir=registry,
                                            kubelet_registration_path="/var/lib/kubelet/plugins/x/csi.sock")),
               threading.Thread(target=serve_mounter, args=(mounter_sock, os.path.join(open_dir, "mnt"), cache),
                                kwargs=dict(ready=mounter_ready, stop=stop), daemon=True)]
    for t in threads:
        t.start()
    try:
        assert csi_ready.wait(30) and mounter_ready.wait(30)
        os.chmod(registry, 0o755)  # (let nobody walk to it: the socket alone must refuse)
        for path in (csi_sock, mounter_sock, keeper_sock, os.path.join(registry, "csi.cachefs.io-reg.sock")):
            assert connect_as(0, path) == "connected"
            assert connect_as(NOBODY, path) == "PermissionError", path
    finally:
        stop.set()
        for t in threads:
            t.join(20)


def test_a_mounts_hand_over_socket_refuses_other_users(s3, open_dir):
    _, client, bucket = s3
    put_tree(client, bucket, "sock", {"a.bin": b"a" * 100})
    cache, mnt = os.path.join(open_dir, "cache"), os.path.join(open_dir, "mnt")
    os.makedirs(mnt)
    m = Mounted(cache, f"s3://{bucket}/sock", mnt)
    try:
        path = socket_path_for(mount_file(cache, mnt, ".sock"))
        for d in (cache, os.path.dirname(path)):  # let nobody walk to it: the socket alone must refuse
            os.chmod(d, 0o755)
        assert connect_as(NOBODY, path) == "PermissionError"
    finally:
        m.close()


def read_as(uid: int, path: str, groups: tuple[int, ...] = ()) -> str:
    """What user ``uid`` (with supplementary ``groups``) reads at ``path``: a file's text, a directory's
    listing, or the name of the error."""
    code = ("import os, sys\nos.setgroups({1}); os.setgid({0}); os.setuid({0})\ntry:\n"
            "    p = sys.argv[1]\n"
            "    print(','.join(sorted(os.listdir(p))) if os.path.isdir(p) else open(p, 'rb').read().decode())\n"
            "except OSError as e:\n    print(type(e).__name__)")
    return subprocess.run([sys.executable, "-c", code.format(uid, list(groups)), path], capture_output=True,
                          text=True, timeout=30).stdout.strip()


@pytest.mark.parametrize("allow_other", [False, True], ids=["default", "allow-other"])
def test_a_mount_is_its_users_alone_unless_allow_other(s3, open_dir, allow_other):
    """With allow_other and mode 0444 any user of the node could read a private bucket through someone else's
    mount; by default only the mounting user (here root) reads it, --allow-other widens it deliberately."""
    _, client, bucket = s3
    put_tree(client, bucket, "private", {"a.txt": b"secret"})
    cache, mnt = os.path.join(open_dir, "cache"), os.path.join(open_dir, "mnt")
    os.makedirs(mnt)
    m = Mounted(cache, f"s3://{bucket}/private", mnt, *(["--allow-other"] if allow_other else []))
    try:
        assert read_as(0, m.path("a.txt")) == "secret"
        assert read_as(NOBODY, m.path("a.txt")) == ("secret" if allow_other else "PermissionError")
    finally:
        m.close()


@pytest.mark.parametrize("mode", ["", "0444"], ids=["group-only", "widened"])
def test_a_mount_for_one_group_refuses_other_users(s3, open_dir, mode):
    """--allow-other --group G (what the CSI driver does with a pod's fsGroup): a user in G reads files and lists
    directories, a user outside it is refused by the kernel; --mode 0444 widens it to everyone deliberately."""
    _, client, bucket = s3
    put_tree(client, bucket, "grp", {"d/a.txt": b"shared"})
    cache, mnt = os.path.join(open_dir, "cache"), os.path.join(open_dir, "mnt")
    os.makedirs(mnt)
    group, member, outsider = 4242, 4243, 4244
    m = Mounted(cache, f"s3://{bucket}/grp", mnt, "--allow-other", "--group", str(group),
                *(["--mode", mode] if mode else []))
    try:
        st = os.stat(m.path("d/a.txt"))
        assert (st.st_gid, st.st_mode & 0o777) == (group, int(mode or "0440", 8))
        assert read_as(member, m.path("d/a.txt"), groups=(group,)) == "shared"
        assert read_as(member, m.path("d"), groups=(group,)) == "a.txt"
        want = "PermissionError" if not mode else "shared"
        assert read_as(outsider, m.path("d/a.txt")) == want
        assert read_as(outsider, m.path("d")) == ("PermissionError" if not mode else "a.txt")
        assert read_as(0, m.path("d/a.txt")) == "shared"
    finally:
        m.close()


def test_a_long_cache_directory_puts_the_hand_over_socket_in_the_runtime_directory(s3, open_dir):
    """A cache directory whose socket path would pass the 108 bytes a unix socket may have: the socket goes to
    /run/cachefs/sockets (root's, 0700) under a short name, and the mount works."""
    _, client, bucket = s3
    put_tree(client, bucket, "long", {"a.txt": b"hello"})
    cache = os.path.join(open_dir, "c" * 120)
    mnt = os.path.join(open_dir, "mnt")
    os.makedirs(mnt)
    assert len(mount_file(cache, mnt, ".sock").encode()) > 108
    m = Mounted(cache, f"s3://{bucket}/long", mnt)
    try:
        with open(m.path("a.txt"), "rb") as f:
            assert f.read() == b"hello"
        path = socket_path_for(mount_file(cache, mnt, ".sock"))
        assert path.startswith("/run/cachefs/sockets/") and os.path.exists(path)
        assert os.stat("/run/cachefs/sockets").st_mode & 0o777 == 0o700
    finally:
        m.close()


def test_a_mount_that_cannot_be_served_is_never_left_behind(open_dir):
    """Mounted, but its hand-over socket cannot be made (its directory is a file): the holder takes the mount down
    again, instead of leaving a dead FUSE mount on the directory."""
    from cachefs.fuse.holder import MountHolder
    from cachefs.fuse.mount import is_fuse_mount

    mnt = os.path.join(open_dir, "mnt")
    os.makedirs(mnt)
    blocker = os.path.join(open_dir, "not-a-dir")
    open(blocker, "w").close()
    holder = MountHolder(mnt, os.path.join(blocker, "x.sock"))
    with pytest.raises(OSError):
        holder.mount()
    assert not is_fuse_mount(mnt)

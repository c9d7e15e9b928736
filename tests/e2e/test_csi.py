"""The CSI plugin for real: csi-sanity (built from csi-test v5.4.0) against `cachefs csi` on a unix socket,
with real FUSE sessions and bind mounts underneath; shared sessions; recovery after a plugin restart."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from cachefs.fuse.mount import is_mount_point, unmount
from csi.gen import csi_pb2 as pb
from csi.gen import csi_pb2_grpc as rpc

from .containers import Container
from .controlplane import build_binaries

pytestmark = pytest.mark.root

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse (CI runs as root)", allow_module_level=True)


class Plugin:
    """`cachefs csi` in its own process (in ``container`` if given; sessions through ``mounter`` if given)."""

    def __init__(self, base: Path, mounter: str = "", container: Container | None = None, keeper: str = "",
                 sock: Path | None = None, extra: tuple[str, ...] = ()) -> None:
        self.base, self.sock = base, sock or base / "csi.sock"
        self.proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "csi", "--endpoint",
                                      f"unix://{self.sock}", "--node-id", "node-1", "--cache-group", "rack-a",
                                      "--cache-dir", str(base / "cache"), "-v",
                                      *(["--mounter", f"unix://{mounter}"] if mounter else []),
                                      *(["--session-keeper", f"unix://{keeper}"] if keeper else []), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if container is not None:
            container.add(self.proc.pid)
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        self.node = rpc.NodeStub(self.channel)
        self.identity = rpc.IdentityStub(self.channel)
        deadline = time.monotonic() + 30
        while True:  # a previous run's socket file may still be there: wait for an answer, not for the file
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                self.identity.Probe(pb.ProbeRequest(), timeout=1)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "CSI plugin did not start"
                time.sleep(0.1)

    def stop(self) -> str:
        self.channel.close()
        return _stop(self.proc)


def _stop(proc: subprocess.Popen) -> str:
    """Terminate a plugin or mounter process; what it printed."""
    hung = ""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:  # say where it is stuck: kernel wait channels and Python stacks
            hung = " ".join(_read(f"/proc/{proc.pid}/task/{t}/wchan") for t in os.listdir(f"/proc/{proc.pid}/task"))
            os.kill(proc.pid, signal.SIGUSR1)  # cachefs prints every thread's stack
            time.sleep(1)
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    proc.stdout.close()
    assert not hung, f"{proc.args[:4]} ignored SIGTERM for 20 s; threads wait in: {hung}\n{out}"
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "-"
    except OSError:
        return "?"


@pytest.fixture
def dataset(tmp_path):
    src = tmp_path / "src"
    files = {f"d{i % 3}/f{i}.bin": os.urandom(1000 * i + 7) for i in range(12)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return f"file://{src}", files


@pytest.fixture
def plugin(tmp_path):
    p = Plugin(tmp_path / "plugin")
    try:
        yield p
    finally:
        try:
            log = p.stop()
        finally:
            unmount_under(tmp_path)
        assert "Traceback" not in log, log
        assert SECRET not in log


def unmount_under(root: Path) -> None:
    """Every mount below ``root`` (bind mounts first, sessions last; their holders exit)."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f]
    for mnt in sorted((m for m in mounts if m.startswith(str(root))), key=lambda m: "/sessions/" in m):
        unmount(mnt)


SECRET = "s3cr3t-never-in-logs"


def publish(p: Plugin, url: str, target: Path, volume_id: str = "vol-static-1", *, fs_group: str = "",
            mode: str = "") -> None:
    """NodePublishVolume of a PV's volume; ``fs_group`` as kubelet passes a pod's fsGroup (the mount group)."""
    p.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=volume_id, target_path=str(target), readonly=True,
        volume_context={"url": url, **({"mode": mode} if mode else {})},
        secrets={"awsAccessKeyID": "AKIA-test", "awsSecretAccessKey": SECRET},
        volume_capability=pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(volume_mount_group=fs_group),
            access_mode=pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY))))


def read_in_pod(target: Path, rel: str, uid: int, groups: tuple[int, ...] = ()) -> str:
    """What a pod's process (``uid``, supplementary ``groups``) reads at ``rel`` in its volume: the pod sees the
    volume at its own path, so the mount is opened as root first (as the container's mount namespace is) and
    only the reads are made as the user."""
    code = ("import os, sys\nroot = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "os.setgroups({1}); os.setgid({0}); os.setuid({0})\ntry:\n"
            "    fd = os.open(sys.argv[2], os.O_RDONLY, dir_fd=root)\n"
            "    print(len(os.read(fd, 1 << 20)))\nexcept OSError as e:\n    print(type(e).__name__)")
    return subprocess.run([sys.executable, "-c", code.format(uid, list(groups)), str(target), rel],
                          capture_output=True, text=True, timeout=30).stdout.strip()


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def test_csi_sanity_against_the_plugin(plugin, dataset, tmp_path):
    url, _ = dataset
    params = tmp_path / "params.yaml"
    params.write_text(f"url: {url}\n")
    sanity = build_binaries() / "csi-sanity"
    # Skipped specs are those whose capability the plugin does not advertise (snapshots, expansion, listing,
    # staging, capacity, ControllerPublish): csi-sanity skips them itself; we skip nothing by hand.
    proc = subprocess.run([str(sanity), "--csi.endpoint", str(plugin.sock), "--csi.testvolumeparameters", str(params),
                           "--csi.mountdir", str(tmp_path / "sanity-mnt"), "--csi.stagingdir",
                           str(tmp_path / "sanity-stage"), "--ginkgo.no-color"], capture_output=True, text=True,
                          timeout=600)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail
    assert " 0 Failed" in tail and "Passed" in tail


def test_pods_share_one_session_and_unpublish_leaves_it(plugin, dataset, tmp_path):
    url, files = dataset
    expected = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    a, b = tmp_path / "pod-a" / "mount", tmp_path / "pod-b" / "mount"
    for t in (a, b):
        t.parent.mkdir()
    publish(plugin, url, a)
    publish(plugin, url, a)  # idempotent
    publish(plugin, url, b, "vol-static-2")
    assert tree_hashes(a) == expected and tree_hashes(b) == expected
    sessions = list((tmp_path / "plugin" / "cache" / "csi" / "sessions").iterdir())
    assert len(sessions) == 1  # one FUSE session for the dataset on this node
    with pytest.raises(OSError):
        (a / "new").write_bytes(b"x")  # read-only
    plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="vol-static-1", target_path=str(a)))
    assert not a.exists()
    assert tree_hashes(b) == expected  # the other pod is untouched
    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="vol-static-2", volume_path=str(b)))
    assert not stats.volume_condition.abnormal
    assert stats.usage[0].total >= sum(len(d) for d in files.values())
    unmount(str(b))  # broken behind the plugin's back: reported abnormal
    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="vol-static-2", volume_path=str(b)))
    assert stats.volume_condition.abnormal and "not mounted" in stats.volume_condition.message
    info = plugin.node.NodeGetInfo(pb.NodeGetInfoRequest())
    assert info.node_id == "node-1" and info.accessible_topology.segments["topology.cachefs.io/cache-group"] == "rack-a"


def test_pods_read_as_any_user_and_an_fs_group_keeps_other_users_out(plugin, dataset, tmp_path):
    """A pod without fsGroup reads as whatever user it runs as; a pod with fsGroup gets a session of its own
    whose files belong to that group (0440), so a process outside the group is refused; the ``mode`` attribute
    widens it on purpose. The sessions themselves sit in a root-only directory."""
    url, files = dataset
    rel, size = "d1/f1.bin", str(len(files["d1/f1.bin"]))
    targets = {name: tmp_path / name / "mount" for name in ("plain", "grouped", "widened")}
    for t in targets.values():
        t.parent.mkdir()
    publish(plugin, url, targets["plain"], "vol-plain")
    publish(plugin, url, targets["grouped"], "vol-grouped", fs_group="4242")
    publish(plugin, url, targets["widened"], "vol-widened", fs_group="4242", mode="0444")
    assert read_in_pod(targets["plain"], rel, uid=1000) == size
    assert read_in_pod(targets["grouped"], rel, uid=1000, groups=(4242,)) == size
    assert read_in_pod(targets["grouped"], rel, uid=1001) == "PermissionError"
    assert read_in_pod(targets["widened"], rel, uid=1001) == size
    st = os.stat(targets["grouped"] / rel)
    assert (st.st_gid, st.st_mode & 0o777) == (4242, 0o440)
    sessions = tmp_path / "plugin" / "cache" / "csi" / "sessions"
    assert len(list(sessions.iterdir())) == 3 and sessions.stat().st_mode & 0o777 == 0o700
    with pytest.raises(grpc.RpcError) as err:
        publish(plugin, url, tmp_path / "bad" / "mount", "vol-bad", fs_group="wheel")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a group id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        publish(plugin, url, tmp_path / "bad" / "mount", "vol-bad", mode="0666")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "only read bits" in err.value.details()
    caps = plugin.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest()).capabilities
    assert pb.NodeServiceCapability.RPC.VOLUME_MOUNT_GROUP in {c.rpc.type for c in caps}


def kubelet_target(root: Path, pod_uid: str, name: str = "data") -> Path:
    """Where kubelet asks a CSI driver to publish (it creates the parent; the driver the target)."""
    target = root / "kubelet" / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / name / "mount"
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def inline_publish(p: Plugin, url: str, target: Path, pod: str) -> None:
    """NodePublishVolume as kubelet sends it for an inline (ephemeral) volume with readOnly: true."""
    p.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=f"csi-{hashlib.sha256(str(target).encode()).hexdigest()}", target_path=str(target), readonly=True,
        volume_context={"url": url, "csi.storage.k8s.io/ephemeral": "true", "csi.storage.k8s.io/pod.name": pod,
                        "csi.storage.k8s.io/pod.namespace": "default", "csi.storage.k8s.io/pod.uid": pod + "-uid",
                        "csi.storage.k8s.io/serviceAccount.name": "default"},
        volume_capability=pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=pb.VolumeCapability.
                                              AccessMode(mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))))


def test_bad_requests_get_clear_codes_and_mount_nothing(plugin, tmp_path):
    mount_cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    cases = [
        ("volume_capability", dict(volume_id="v", target_path=str(tmp_path / "t1"))),
        ("required", dict(volume_id="v", target_path=str(tmp_path / "t2"), volume_capability=mount_cap,
                          volume_context={"region": "x"})),  # no url
        ("scheme", dict(volume_id="v", target_path=str(tmp_path / "t3"), volume_capability=mount_cap,
                        volume_context={"url": "nosuchscheme://bucket/x"})),
        ("not a URL", dict(volume_id="v", target_path=str(tmp_path / "t4"), volume_capability=mount_cap,
                           volume_context={"url": "not a url"})),
        ("unknown volume attribute", dict(volume_id="v", target_path=str(tmp_path / "t5"), volume_capability=mount_cap,
                                          volume_context={"url": "file:///tmp", "bucket": "x"})),
        ("ReadWriteMany", dict(volume_id="v", target_path=str(tmp_path / "t6"), volume_context={"url": "file:///tmp"},
                               volume_capability=pb.VolumeCapability(
                                   mount=pb.VolumeCapability.MountVolume(), access_mode=pb.VolumeCapability.AccessMode(
                                       mode=pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER)))),
        ("block", dict(volume_id="v", target_path=str(tmp_path / "t7"), volume_context={"url": "file:///tmp"},
                       volume_capability=pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume()))),
        ("not a directory", dict(volume_id="v", target_path=str(not_a_dir), volume_capability=mount_cap,
                                 volume_context={"url": "file:///tmp"})),
        ("bytes, over", dict(volume_id="v" * 100_000, target_path=str(tmp_path / "t8"), volume_capability=mount_cap,
                             volume_context={"url": "file:///tmp"})),
    ]
    for words, req in cases:
        with pytest.raises(grpc.RpcError) as exc:
            plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(**req), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, exc.value.details())
        assert words in exc.value.details(), (words, exc.value.details())
    with pytest.raises(grpc.RpcError) as exc:  # a static volume id that names no dataset, and no url attribute
        plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(volume_id="v", target_path=str(tmp_path / "t9"),
                                                                  volume_capability=mount_cap))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    with open("/proc/self/mountinfo") as f:  # nothing mounted (other tests may mount meanwhile: only ours counts)
        assert str(tmp_path) not in f.read()
    assert not any((tmp_path / f"t{i}").exists() for i in range(1, 10))  # nothing created
    assert not (tmp_path / "plugin" / "cache" / "csi" / "sessions").exists() or not any(
        (tmp_path / "plugin" / "cache" / "csi" / "sessions").iterdir())


def test_a_dataset_that_cannot_open_fails_the_publish_with_its_cause(plugin, tmp_path):
    mount_cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:  # the cause, at once, instead of a target that hangs
        plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id="v-missing", target_path=str(tmp_path / "target"), volume_capability=mount_cap,
            volume_context={"url": "file:///nonexistent-dataset"}), timeout=120)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND, exc.value.details()
    assert "file:///nonexistent-dataset" in exc.value.details() and "not found" in exc.value.details()
    assert time.monotonic() - start < 60
    with open("/proc/self/mountinfo") as f:  # nothing mounted (other tests may mount meanwhile: only ours counts)
        assert str(tmp_path) not in f.read()
    assert not (tmp_path / "target").exists()


def test_kubelet_style_publishes_survive_killing_daemon_and_plugin_mid_read(tmp_path, dataset):
    from cachefs.index.mounts import list_mounts

    url, files = dataset
    expected = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    big = max(files, key=lambda r: len(files[r]))
    a, b = kubelet_target(tmp_path, "uid-a"), kubelet_target(tmp_path, "uid-b")
    first = Plugin(tmp_path / "plugin")
    second = None
    try:
        inline_publish(first, url, a, "pod-a")
        inline_publish(first, url, b, "pod-b")
        assert tree_hashes(a) == expected == tree_hashes(b)
        assert len(list((tmp_path / "plugin" / "cache" / "csi" / "sessions").iterdir())) == 1
        first.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=f"csi-{hashlib.sha256(str(a).encode()).hexdigest()}", target_path=str(a)))
        assert not a.exists() and tree_hashes(b) == expected  # unpublishing one pod leaves the other reading

        cache = str(tmp_path / "plugin" / "cache")
        with open(b / big, "rb") as reader:  # a pod holds a file open and is mid-read
            head = reader.read(1000)
            (daemon,) = list_mounts(cache)
            os.kill(daemon["pid"], signal.SIGKILL)
            first.proc.kill()
            first.proc.wait()
            rest = reader.read()
        assert hashlib.sha256(head + rest).hexdigest() == expected[big]
        second = Plugin(tmp_path / "plugin")
        c = kubelet_target(tmp_path, "uid-c")
        inline_publish(second, url, c, "pod-c")  # new publishes work after both restarts
        assert tree_hashes(c) == expected and tree_hashes(b) == expected
    finally:
        try:
            for p in (first, second):
                if p is not None:
                    p.stop()
        finally:
            unmount_under(tmp_path)


def test_plugin_restart_keeps_serving_and_repairs_missing_targets(tmp_path, dataset):
    url, files = dataset
    expected = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    first = Plugin(tmp_path / "plugin")
    a, b = tmp_path / "pod-a" / "mount", tmp_path / "pod-b" / "mount"
    try:
        for t, vid in ((a, "va"), (b, "vb")):
            t.parent.mkdir()
            publish(first, url, t, vid)
        first.proc.kill()  # the plugin dies; the session's holder lives on
        first.proc.wait()
        assert tree_hashes(a) == expected  # pods keep reading while the plugin is down
        unmount(str(b))  # and one target is lost meanwhile (e.g. a node-level cleanup)
        assert not is_mount_point(str(b))
        second = Plugin(tmp_path / "plugin")
        try:
            assert is_mount_point(str(b)) and tree_hashes(b) == expected  # repaired from the record at start
            assert tree_hashes(a) == expected
        finally:
            log = second.stop()
        assert "repaired 1 published volume" in log
    finally:
        try:
            first.stop()
        finally:
            unmount_under(tmp_path)


def test_killed_fuse_daemon_under_a_published_target_is_replaced_and_pods_keep_reading(plugin, dataset, tmp_path):
    from cachefs.index.mounts import list_mounts

    url, files = dataset
    expected = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    target = tmp_path / "pod-a" / "mount"
    target.parent.mkdir()
    publish(plugin, url, target)
    assert tree_hashes(target) == expected
    cache = str(tmp_path / "plugin" / "cache")
    (daemon,) = list_mounts(cache)
    os.kill(daemon["pid"], signal.SIGKILL)
    assert tree_hashes(target) == expected  # the holder restarted the daemon; the pod's mount never broke
    deadline = time.monotonic() + 30
    while not [m for m in list_mounts(cache) if m["pid"] and m["pid"] != daemon["pid"]]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id="vol-static-1",
                                                                        volume_path=str(target)))
    assert not stats.volume_condition.abnormal


class MounterProcess:
    """`cachefs csi-mounter` in its own container, as in the node DaemonSet."""

    def __init__(self, base: Path, container: Container, keeper: str = "", run: Path | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        from csi.mounter import RemoteMounter

        self.sock = str((run or base / "run") / "mounter.sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "csi-mounter", "--socket",
                                      f"unix://{self.sock}", "--cache-dir", str(base / "cache"), "-v",
                                      *(["--session-keeper", f"unix://{keeper}"] if keeper else []), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        container.add(self.proc.pid)
        deadline = time.monotonic() + 30
        while not RemoteMounter(self.sock).healthy()[0]:
            assert self.proc.poll() is None, self.proc.stdout.read()
            assert time.monotonic() < deadline, "mounter did not start"
            time.sleep(0.1)

    def stop(self) -> str:
        return _stop(self.proc)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_restarting_the_plugin_container_leaves_sessions_in_the_mounter_container(tmp_path, dataset):
    """The DaemonSet's layout: sessions are started by the mounter container, so killing every process of the
    plugin's container (what a container restart does) leaves pods reading, with no repair needed."""
    from cachefs.index.mounts import list_mounts

    url, files = dataset
    expected = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    big = max(files, key=lambda r: len(files[r]))
    base, cache = tmp_path / "plugin", str(tmp_path / "plugin" / "cache")
    mounter_ct, plugin_ct, plugin_ct2 = Container("mounter"), Container("plugin"), Container("plugin2")
    mounter = MounterProcess(base, mounter_ct)
    first = second = None
    log = ""
    try:
        first = Plugin(base, mounter.sock, plugin_ct)
        a, b = kubelet_target(tmp_path, "uid-a"), kubelet_target(tmp_path, "uid-b")
        inline_publish(first, url, a, "pod-a")
        inline_publish(first, url, b, "pod-b")
        assert tree_hashes(a) == expected == tree_hashes(b)
        (daemon,) = list_mounts(cache)
        assert _ppid(_ppid(daemon["pid"])) == mounter.proc.pid  # daemon ← holder ← mounter, not the plugin
        with open(b / big, "rb") as reader:  # a pod is mid-read when the plugin's container restarts
            head = reader.read(1000)
            plugin_ct.kill()
            first.proc.wait()
            rest = reader.read()
        assert hashlib.sha256(head + rest).hexdigest() == expected[big]
        assert [m["pid"] for m in list_mounts(cache)] == [daemon["pid"]]  # the same daemon: nothing broke
        assert tree_hashes(a) == expected

        second = Plugin(base, mounter.sock, plugin_ct2)
        c = kubelet_target(tmp_path, "uid-c")
        inline_publish(second, url, c, "pod-c")  # the running session is reused
        assert tree_hashes(c) == expected
        assert len(list((base / "cache" / "csi" / "sessions").iterdir())) == 1

        # The mounter down: Probe says so, a publish that needs a new session is UNAVAILABLE (kubelet retries),
        # publishes of running sessions still work, and all works again once it is back.
        mounter.stop()
        with pytest.raises(grpc.RpcError) as exc:
            second.identity.Probe(pb.ProbeRequest(), timeout=10)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "mounter" in exc.value.details()
        other = f"{url}/d0"
        with pytest.raises(grpc.RpcError) as exc:
            inline_publish(second, other, kubelet_target(tmp_path, "uid-d"), "pod-d")
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "mounter is not running" in exc.value.details()
        e = kubelet_target(tmp_path, "uid-e")
        inline_publish(second, url, e, "pod-e")
        assert tree_hashes(e) == expected
        mounter = MounterProcess(base, mounter_ct)
        second.identity.Probe(pb.ProbeRequest(), timeout=10)
        d = kubelet_target(tmp_path, "uid-d")
        inline_publish(second, other, d, "pod-d")
        assert tree_hashes(d) == {rel.split("/", 1)[1]: h for rel, h in expected.items() if rel.startswith("d0/")}
    finally:
        try:
            for p in (first, second):
                if p is not None:
                    log += p.stop()
            log += mounter.stop()
        finally:
            unmount_under(tmp_path)
            for ct in (plugin_ct, plugin_ct2, mounter_ct):
                ct.remove()
    assert "Traceback" not in log


def test_killing_every_process_of_the_mounter_container_mid_read_loses_no_session(tmp_path, dataset):
    """The mounter's container dies (kill -9, OOM) with every holder and daemon in it: the plugin's session keeper
    holds a copy of each session's descriptor, so the mounts stay connected and readers wait; the restarted
    mounter adopts the sessions and the readers finish with every byte (before the keeper: ENOTCONN)."""
    import threading

    url, files = dataset
    expected = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    base = tmp_path / "plugin"
    keeper = str(base / "run" / "keeper.sock")
    mounter_ct, mounter_ct2, plugin_ct = Container("mounter"), Container("mounter2"), Container("plugin")
    plugin = mounter = None
    log = ""
    try:
        mounter = MounterProcess(base, mounter_ct, keeper)
        plugin = Plugin(base, mounter.sock, plugin_ct, keeper=keeper)
        a = kubelet_target(tmp_path, "uid-a")
        inline_publish(plugin, url, a, "pod-a")
        first = sorted(files)[0]
        assert hashlib.sha256((a / first).read_bytes()).hexdigest() == expected[first]
        deadline = time.monotonic() + 10
        from cachefs.fuse.keeper import kept_sessions

        while not kept_sessions(keeper):
            assert time.monotonic() < deadline, "the holder never deposited its descriptor"
            time.sleep(0.05)
        mounter_ct.kill()  # the container's every process: mounter, holder, daemon
        log += mounter.stop()
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(tree_hashes(a)))  # files no one looked up yet
        reader.start()
        reader.join(1.0)
        assert reader.is_alive(), "with no daemon the reads should wait, not fail"
        mounter = MounterProcess(base, mounter_ct2, keeper)
        reader.join(60)
        assert not reader.is_alive() and got == expected
    finally:
        try:
            for proc in (plugin, mounter):
                if proc is not None:
                    log += proc.stop()
        finally:
            unmount_under(tmp_path)
            for ct in (plugin_ct, mounter_ct, mounter_ct2):
                ct.remove()
    assert "adopted 1 session(s)" in log, log
    assert "Traceback" not in log


def test_the_next_node_pod_generation_takes_every_session_over_while_a_pod_reads(tmp_path, dataset):
    """The DaemonSet rolls: a second generation of the node pod (containers of its own; its keeper beside the first
    one's in the keepers directory both see) starts while the first serves. Its mounter takes the session over: the
    first generation's holder retires without unmounting, and the new daemon resumes from the mount journal. The
    first generation then leaves at once, and its containers' processes are killed: the pod read throughout,
    never an error, every byte right, and the mount is served from the second generation's container."""
    import threading

    from cachefs.fuse.keeper import kept_sessions

    url, files = dataset
    expected = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    base, keepers = tmp_path / "node", tmp_path / "node" / "keepers"
    keeper_a, keeper_b = str(keepers / "gen-a.sock"), str(keepers / "gen-b.sock")
    cts = {n: Container(n) for n in ("a-mounter", "a-plugin", "b-mounter", "b-plugin")}
    procs: list = []
    log = ""
    errors: list[str] = []
    rounds = [0]
    reading = threading.Event()
    try:
        wait = ("--handover-wait", "60")
        mounter_a = MounterProcess(base, cts["a-mounter"], keeper_a, run=base / "run-a", extra=wait)
        plugin_a = Plugin(base, mounter_a.sock, cts["a-plugin"], keeper=keeper_a, sock=base / "csi-a.sock", extra=wait)
        procs += [plugin_a, mounter_a]
        target = kubelet_target(tmp_path, "uid-a")
        inline_publish(plugin_a, url, target, "pod-a")
        deadline = time.monotonic() + 10
        while not kept_sessions(keeper_a):
            assert time.monotonic() < deadline, "the holder never deposited its descriptor"
            time.sleep(0.05)

        def read_on() -> None:
            while not reading.is_set():
                try:
                    got = tree_hashes(target)
                    if got != expected:
                        errors.append(f"wrong bytes in {sorted(k for k in expected if got.get(k) != expected[k])}")
                except OSError as exc:
                    errors.append(repr(exc))
                rounds[0] += 1

        reader = threading.Thread(target=read_on)
        reader.start()
        mounter_b = MounterProcess(base, cts["b-mounter"], keeper_b, run=base / "run-b")
        plugin_b = Plugin(base, mounter_b.sock, cts["b-plugin"], keeper=keeper_b, sock=base / "csi-b.sock")
        procs += [plugin_b, mounter_b]
        deadline = time.monotonic() + 60
        while kept_sessions(keeper_a) or not kept_sessions(keeper_b):
            assert time.monotonic() < deadline, "the session was not taken over"
            time.sleep(0.1)
        before = rounds[0]
        log += plugin_a.stop() + mounter_a.stop()  # nothing left to wait for: both leave at once
        procs = [plugin_b, mounter_b]
        for name in ("a-mounter", "a-plugin"):
            cts[name].kill()  # whatever of the first generation is left goes, as with its pod
        deadline = time.monotonic() + 30
        while rounds[0] < before + 3:
            assert time.monotonic() < deadline, "reads stopped after the first generation left"
            time.sleep(0.1)
        reading.set()
        reader.join(30)
        assert errors == [] and tree_hashes(target) == expected
        holder = [p for p in cts["b-mounter"].members() if b"--adopt" in _cmdline(p)]
        assert holder, "no holder in the second generation's container"
    finally:
        reading.set()
        stuck = []
        try:
            for proc in procs:  # every process's log, even after one was stuck: the others say why
                try:
                    log += proc.stop()
                except AssertionError as exc:
                    stuck.append(str(exc))
            print(log)  # (shown with a failure above, which would otherwise hide it)
        finally:
            unmount_under(tmp_path)
            for ct in cts.values():
                ct.remove()
    assert not stuck, "\n".join(stuck) + "\n" + log
    assert "took over 1 session(s)" in log, log
    assert "Traceback" not in log


def test_a_plugin_on_its_way_out_leaves_the_next_node_pods_sockets_alone(tmp_path):
    """The next node pod's plugin binds the same CSI and registration socket paths (kubelet knows only those). The
    old plugin, stopped after it, must not remove them: gRPC removes whatever socket is at a path it bound when its
    server stops, and kubelet then unregistered the driver (a rolling update on the real node did)."""
    import socket

    from csi.registration import registration_socket

    registry = tmp_path / "registry"
    plugin = Plugin(tmp_path, extra=("--mode", "node", "--registration-dir", str(registry),
                                     "--kubelet-registration-path", "/var/lib/kubelet/plugins/csi.cachefs.io/csi.sock"))
    reg = registration_socket(str(registry), "csi.cachefs.io")
    deadline = time.monotonic() + 30
    while not os.path.exists(reg):
        assert time.monotonic() < deadline, "no registration socket"
        time.sleep(0.05)
    successor = []
    for path in (str(plugin.sock), reg):  # the next pod's plugin: new sockets at the same paths
        os.unlink(path)
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.listen()
        successor.append((s, path, os.stat(path).st_ino))
    try:
        out = plugin.stop()
        for _s, path, ino in successor:
            assert os.path.exists(path) and os.stat(path).st_ino == ino, f"{path} removed\n{out}"
        assert "leaving its sockets as they are" in out
    finally:
        for s, _path, _ino in successor:
            s.close()


def test_a_session_no_pod_uses_is_stopped_after_the_idle_time_and_the_cache_stays(tmp_path, dataset):
    from cachefs.fuse.mount import bind_mount, is_fuse_mount
    from csi.sessions import SessionManager
    from csi.volume import DatasetVolume

    url, files = dataset
    expected = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    cache = tmp_path / "cache"
    mgr = SessionManager(str(cache / "csi"), str(cache))
    vol = DatasetVolume(url)
    a, b, extra = tmp_path / "a" / "mount", tmp_path / "b" / "mount", tmp_path / "extra"
    try:
        mgr.publish(vol, str(a))
        mgr.publish(vol, str(b))
        assert tree_hashes(a) == expected
        session = mgr.session_path(vol)
        assert mgr.stop_idle_sessions(0) == []  # two pods use it
        mgr.unpublish(str(a))
        assert mgr.stop_idle_sessions(0) == [] and tree_hashes(b) == expected
        extra.mkdir()
        bind_mount(session, str(extra), readonly=True)  # a bind mount the record does not know of
        mgr.unpublish(str(b))
        assert mgr.stop_idle_sessions(0) == [] and is_fuse_mount(session)
        unmount(str(extra))
        def cached_files() -> list[str]:  # objects of their own and pack files
            return sorted(p.name for d in ("data", "packs") for p in (cache / d).rglob("*") if p.is_file())

        deadline = time.monotonic() + 10
        while not any(n.endswith(".arrow") for n in cached_files()):  # the small files' pack is written ~1 s on
            assert time.monotonic() < deadline, "no pack written"
            time.sleep(0.1)
        cached = cached_files()
        assert mgr.stop_idle_sessions(3600) == []  # unused from now on: the idle clock starts
        assert mgr.stop_idle_sessions(3600) == []  # … and has not run out
        assert mgr.stop_idle_sessions(0) == [vol.session_key]
        assert not is_mount_point(session) and not os.path.exists(os.path.dirname(session))
        (holder,) = mgr.mounter.holders
        assert holder.wait(20) == 0  # the session's holder exited
        assert cached_files() == cached
        c = tmp_path / "c" / "mount"
        mgr.publish(vol, str(c))  # the next pod gets a new session over the same cache
        assert tree_hashes(c) == expected
    finally:
        unmount_under(tmp_path)
        for h in mgr.mounter.holders:
            h.wait(20)


def test_a_writable_volume_takes_rwx_writes_as_the_pods_group_and_unpublish_waits_for_the_upload(plugin, tmp_path,
                                                                                                 s3):
    server, client, bucket = s3
    url = f"s3://{bucket}/ckpt"
    env = server.env()  # (the plugin started before the origin: its address and credentials come with the volume)
    attrs = {"url": url, "writable": "true", "endpointUrl": env["AWS_ENDPOINT_URL"]}
    secrets = {"awsAccessKeyID": env["AWS_ACCESS_KEY_ID"], "awsSecretAccessKey": env["AWS_SECRET_ACCESS_KEY"]}
    cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(volume_mount_group="4242"),
                              access_mode=pb.VolumeCapability.AccessMode(
                                  mode=pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER))
    # A dataset volume still refuses ReadWriteMany; a checkpoint volume takes it, and an attribute it cannot use.
    for context in ({"url": url}, {"url": url, "writable": "yes"}, {"url": "file:///tmp", "writable": "true"}):
        with pytest.raises(grpc.RpcError) as err:
            plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(
                volume_id="vol-ckpt", target_path=str(tmp_path / "bad"), volume_context=context,
                volume_capability=cap))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    targets = [kubelet_target(tmp_path / "kubelet", f"pod-{i}", "ckpt") for i in range(2)]
    for target in targets:  # two pods of the job on this node: one session, both read-write
        plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id="vol-ckpt", target_path=str(target), volume_context=attrs, secrets=secrets,
            volume_capability=cap))
    data = os.urandom(3 << 20)
    code = ("import os, sys\nroot = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "os.setgroups([4242]); os.setgid(4242); os.setuid(1000)\n"
            "os.mkdir('step-1.tmp', dir_fd=root)\n"
            "fd = os.open('step-1.tmp/rank0.pt', os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=root)\n"
            "os.write(fd, sys.stdin.buffer.read()); os.close(fd)\n"
            "os.rename('step-1.tmp', 'step-1', src_dir_fd=root, dst_dir_fd=root)\n"
            "print(os.stat('step-1/rank0.pt', dir_fd=root).st_uid)")
    server.proc.send_signal(signal.SIGSTOP)  # the origin stalls: the upload waits
    try:
        r = subprocess.run([sys.executable, "-c", code, str(targets[0])], input=data, capture_output=True,
                           timeout=60)
        assert r.stdout.strip() == b"1000", r.stderr  # written as the pod's user, in the pod's group
        with open(targets[1] / "step-1" / "rank0.pt", "rb") as f:  # the other pod reads it back on this node
            assert f.read() == data
        plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="vol-ckpt",
                                                                      target_path=str(targets[0])))
        last = plugin.node.NodeUnpublishVolume.future(pb.NodeUnpublishVolumeRequest(volume_id="vol-ckpt",
                                                                                    target_path=str(targets[1])))
        time.sleep(1.5)
        assert not last.done()  # the node's last pod of the volume leaves only once its checkpoint is uploaded
    finally:
        server.proc.send_signal(signal.SIGCONT)
    last.result(timeout=60)
    got = client.get_object(Bucket=bucket, Key="ckpt/step-1/rank0.pt")["Body"].read()
    assert got == data
    assert client.head_object(Bucket=bucket, Key="ckpt/.cachefs/commits/step-1.json")

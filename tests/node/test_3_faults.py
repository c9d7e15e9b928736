"""Faults on the node while a pod reads: kubelet restarted, the container runtime restarted, the CSI container killed,
the mounter container killed, the node pod replaced (a rolling restart, a deleted pod), a pod deleted mid-read, the
cache disk full.

Each run has a reader pod walk a dataset nobody read yet (so its reads need the FUSE daemon and the origin, not the
page cache), pacing itself so that the fault lands mid-read, then read everything once more; every byte is checked
against the origin's digests (a ConfigMap). What it saw — errors, wrong bytes, the longest wait for one file — what
was left mounted on the host and what kubelet logged are reported at the end of the run and asserted: no error, no
wrong byte, nothing stale."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import subprocess
import time

import pytest

from tests.e2e.controlplane import REPO

from .cluster import CACHE_DIR, mounts_under
from .conftest import REPORT
from .harness import BUCKET, IMAGE, NEXT_IMAGE, digest, last_json

#: The longest a reader may wait for one file across a fault ("a stall of at most a few seconds").
MAX_STALL_S = 10.0

READ_LOOP = r"""
import hashlib, json, os, sys, time
root, want, pace = sys.argv[1], json.load(open(sys.argv[2])), float(sys.argv[3])
names = sorted(want)
out = {"reads": 0, "errors": 0, "wrong": 0, "first_errors": [], "max_wait_s": 0.0}
print("started", flush=True)
for turn in range(2):  # the first pass reads from the origin, paced; the second checks what the cache kept
    for rel in names:
        t = time.monotonic()
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            out["reads"] += 1
            if hashlib.sha256(data).hexdigest() != want[rel]:
                out["wrong"] += 1
        except OSError as exc:
            out["errors"] += 1
            if len(out["first_errors"]) < 10:
                out["first_errors"].append(f"{rel}: {exc}")
        out["max_wait_s"] = max(out["max_wait_s"], time.monotonic() - t)
        if turn == 0:
            time.sleep(pace)
print(json.dumps(out), flush=True)
"""


def cold_dataset(cluster, name: str, files: int = 300) -> tuple[str, dict[str, str]]:
    """A dataset of its own at ``faults/<name>`` (small and multi-block files), never read before."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(name)
    data = {f"d{i % 6}/f{i:04d}.bin": rng.randbytes(rng.randint(10_000, 90_000)) for i in range(files)}
    data.update({f"big/{i}.bin": rng.randbytes(6_000_000) for i in range(3)})
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: cluster.s3_client.put_object(Bucket=BUCKET, Key=f"faults/{name}/{kv[0]}",
                                                              Body=kv[1]), data.items()))
    return cold_dataset_url(name), {rel: digest(b) for rel, b in data.items()}


def start_reader(cluster, name: str, url: str, want: dict[str, str], pace: float = 0.05, dataset: str = "") -> None:
    """A pod reading ``url`` in a loop, checking every byte (``dataset``: its volume names that CacheDataset instead
    of the URL and credentials)."""
    csi = ({"driver": "csi.cachefs.io", "readOnly": True, "volumeAttributes": {"dataset": dataset}} if dataset else
           {"driver": "csi.cachefs.io", "readOnly": True,
            "volumeAttributes": {"url": url, "endpointUrl": cluster.s3.endpoint, "region": "us-east-1"},
            "nodePublishSecretRef": {"name": "dataset-credentials"}})
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-want", "namespace": "default",
                                                                     "labels": {"cachefs-test": "want"}},
                   "data": {"want.json": json.dumps(want)}})
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
        "containers": [{"name": "reader", "image": IMAGE, "imagePullPolicy": "Never",
                        "command": ["python3", "-c", READ_LOOP, "/data", "/want/want.json", str(pace)],
                        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True},
                                         {"name": "want", "mountPath": "/want"}]}],
        "volumes": [{"name": "data", "csi": csi},
                    {"name": "want", "configMap": {"name": f"{name}-want"}}]}})
    cluster.wait(lambda: "started" in cluster.kubectl("logs", name, check=False), f"{name} reading", 180)
    time.sleep(3)  # well into the first pass


def reader_result(cluster, name: str, timeout: float = 300) -> dict:
    phase = cluster.wait_pod(name, ("Succeeded", "Failed"), timeout=timeout)
    out = cluster.logs(name)
    assert phase == "Succeeded", f"{name}: {phase}\n{out[-2000:]}"
    return last_json(out)


def pid_of(pattern: str) -> int:
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, f"{pattern!r}: {pids}"
    return int(pids[0])


def kubelet_errors(cluster, since: int) -> list[str]:
    """kubelet's error lines about volumes and CSI logged after byte offset ``since`` of its log."""
    text = cluster.node.log("kubelet")[since:]
    return [line for line in text.splitlines() if line.startswith("E") and re.search(r"(?i)csi|volume|mount", line)]


def stale_mounts() -> list[str]:
    """Mounts of cachefs sessions or pods' volumes that no longer answer (ENOTCONN)."""
    stale = []
    for m in mounts_under("/var/lib/cachefs/csi/sessions") + [
            p for p in mounts_under("/var/lib/kubelet/pods") if "kubernetes.io~csi" in p]:
        try:
            os.stat(m)
        except OSError:
            stale.append(m)
    return stale


def run_fault(cluster, name: str, inject, *, check_log: bool = True) -> dict:
    url, want = cold_dataset(cluster, name)
    log_from = len(cluster.node.log("kubelet"))
    start_reader(cluster, name, url, want)
    t0 = time.monotonic()
    inject()
    result = reader_result(cluster, name)
    result["fault_to_done_s"] = round(time.monotonic() - t0, 1)
    uid = cluster.get("pod", name)["metadata"]["uid"]
    cluster.delete_pod(name)
    pod_dir = f"/var/lib/kubelet/pods/{uid}"
    # kubelet's housekeeping removes the pod's directory once every volume of it is unmounted: a mount left behind
    # keeps it there (and is reported below)
    deadline = time.monotonic() + 120
    while os.path.exists(pod_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    result["left_mounted"] = [m for m in mounts_under("/var/lib/kubelet/pods") if "kubernetes.io~csi" in m]
    if result["left_mounted"]:
        result["kubelet_on_the_pod"] = [line for line in cluster.node.log("kubelet").splitlines() if uid in line][-15:]
    result["stale"] = stale_mounts()
    result["kubelet_errors"] = kubelet_errors(cluster, log_from) if check_log else []
    REPORT[name] = (f"errors {result['errors']}, wrong bytes in {result['wrong']} files, longest wait "
                    f"{result['max_wait_s']:.1f} s, left mounted {len(result['left_mounted'])}, stale "
                    f"{len(result['stale'])}, kubelet volume errors {len(result['kubelet_errors'])}")
    return result


def assert_unharmed(result: dict) -> None:
    assert result["wrong"] == 0
    assert result["errors"] == 0, result["first_errors"]
    assert result["max_wait_s"] < MAX_STALL_S
    assert result["left_mounted"] == [] and result["stale"] == [], result.get("kubelet_on_the_pod")


def test_kubelet_restarted_under_a_reading_pod(cluster):
    result = run_fault(cluster, "kubelet-restart", lambda: cluster.node.restart("kubelet"))
    assert_unharmed(result)
    cluster.node.wait_ready()


def test_container_runtime_restarted_under_a_reading_pod(cluster):
    result = run_fault(cluster, "containerd-restart", lambda: cluster.node.restart("containerd"))
    assert_unharmed(result)


def test_csi_container_killed_under_a_reading_pod(cluster):
    result = run_fault(cluster, "csi-killed", lambda: os.kill(pid_of("cachefs csi --mode node"), 9))
    assert_unharmed(result)
    cluster.wait_rollout("daemonset", "cachefs-node")


def test_mounter_container_killed_under_a_reading_pod(cluster):
    result = run_fault(cluster, "mounter-killed", lambda: os.kill(pid_of("cachefs csi-mounter"), 9))
    assert_unharmed(result)
    cluster.wait_rollout("daemonset", "cachefs-node")


def node_pod(cluster) -> dict:
    """The node pod that is not on its way out."""
    pods = json.loads(cluster.kubectl("get", "pods", "-n", "cachefs-system", "-l",
                                      "app.kubernetes.io/component=node", "-o", "json"))["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert len(live) == 1, [p["metadata"]["name"] for p in pods]
    return live[0]


def replaced_node_pod(cluster, name: str, replace) -> None:
    """Replace the node pod (``replace(pod name)``) while a pod reads a cold dataset: the next node pod takes the
    reader's session over, the first one goes, and the reader sees no error, no wrong byte, no long wait."""
    before = node_pod(cluster)["metadata"]["name"]
    sessions: list[str] = []  # (the reader's, and those other tests left idle: each is taken over)

    def inject() -> None:
        sessions.extend(mounts_under("/var/lib/cachefs/csi/sessions"))
        replace(before)

    result = run_fault(cluster, name, inject)
    cluster.wait_rollout("daemonset", "cachefs-node")
    cluster.wait(lambda: not cluster.exists("pod", before, "cachefs-system"), f"{before} gone", 240)
    after = node_pod(cluster)["metadata"]["name"]
    took = cluster.kubectl("logs", "-n", "cachefs-system", after, "-c", "mounter")
    REPORT[f"{name}: the next node pod"] = "; ".join(line.split("] ", 1)[-1] for line in took.splitlines()
                                                   if "took over" in line) or "took over nothing"
    if result["kubelet_errors"]:
        REPORT[f"{name}: kubelet's volume errors meanwhile (first 3)"] = " | ".join(
            e[:300] for e in result["kubelet_errors"][:3])
    assert after != before
    assert_unharmed(result)
    assert sessions and f"took over {len(sessions)} session(s)" in took and all(m in took for m in sessions), \
        (sessions, took[-3000:])
    # The cache stayed warm: a fresh pod reading the whole dataset now asks the origin for nothing.
    url, want = cold_dataset_url(name), json.loads(cluster.get("configmap", f"{name}-want")["data"]["want.json"])
    gets_before = origin_gets_under(cluster, url)
    start_reader(cluster, f"{name}-after", url, want, pace=0.0)
    again = reader_result(cluster, f"{name}-after")
    cluster.delete_pod(f"{name}-after")
    fetched = origin_gets_under(cluster, url) - gets_before
    REPORT[f"{name}: a fresh pod reading the dataset after the upgrade"] = (
        f"errors {again['errors']}, wrong {again['wrong']}, origin GETs {fetched}")
    assert again["errors"] == 0 and again["wrong"] == 0 and fetched == 0


def cold_dataset_url(name: str) -> str:
    return f"s3://{BUCKET}/faults/{name}"


def origin_gets_under(cluster, url: str) -> int:
    """GETs the origin served for objects under ``url`` so far."""
    prefix = "/" + url[len("s3://"):] + "/"
    return sum(n for key, n in cluster.s3.requests()["gets"].items() if key.startswith(prefix))


def test_the_node_pod_rolled_over_by_a_rollout_restart_under_a_reading_pod(cluster):
    replaced_node_pod(cluster, "node-pod-rollout", lambda _pod: cluster.kubectl(
        "rollout", "restart", "daemonset/cachefs-node", "-n", "cachefs-system"))


def test_the_node_pod_upgraded_to_another_build_by_kubectl_set_image_under_a_reading_pod(cluster):
    """The upgrade as docs/UPGRADES.md says it: `kubectl set image` to another build of the image (tests/node/build.sh
    makes a second one: another image id). The next pod runs it and takes the reader's session over."""
    before = {c["name"]: c["imageID"] for c in node_pod(cluster)["status"]["containerStatuses"]}
    replaced_node_pod(cluster, "node-pod-set-image", lambda _pod: cluster.kubectl(
        "set", "image", "daemonset/cachefs-node", "-n", "cachefs-system", f"*={NEXT_IMAGE}"))
    pod = node_pod(cluster)
    after = {c["name"]: c["imageID"] for c in pod["status"]["containerStatuses"]}
    REPORT["node-pod-set-image: image ids before and after"] = f"{sorted(set(before.values()))} -> " \
                                                                f"{sorted(set(after.values()))}"
    assert all(c["image"] == NEXT_IMAGE for c in pod["spec"]["containers"])
    assert set(after) == set(before) and not set(after.values()) & set(before.values())


def test_the_node_pod_deleted_under_a_reading_pod(cluster):
    replaced_node_pod(cluster, "node-pod-deleted", lambda pod: cluster.kubectl(
        "delete", "pod", "-n", "cachefs-system", pod, "--wait=false"))


WRITE_STEPS = r"""
import hashlib, json, os, sys, time
run, steps, pace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
out = {"files": {}, "errors": [], "max_op_s": 0.0}
print("started", flush=True)
for i in range(steps):  # a checkpoint per step: written under a temporary name, then renamed into place
    t = time.monotonic()
    try:
        tmp, final = os.path.join(run, f"step-{i}.tmp"), os.path.join(run, f"step-{i}")
        os.makedirs(tmp)
        for name, size in (("model.pt", 2_000_000 + i), ("optim.pt", 500_000 + i)):
            data = os.urandom(size)
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
            out["files"][f"step-{i}/{name}"] = hashlib.sha256(data).hexdigest()
        os.rename(tmp, final)
    except OSError as exc:
        out["errors"].append(f"step {i}: {exc}")
    out["max_op_s"] = max(out["max_op_s"], time.monotonic() - t)
    time.sleep(pace)
print(json.dumps(out), flush=True)
"""


def test_a_checkpoint_written_and_renamed_while_the_node_pod_is_replaced_reaches_the_origin_whole(cluster):
    """A writable volume's session moves to the next node pod mid-checkpointing: the writer sees no error, and
    every step it closed and renamed is on the origin after its pod ends (unpublish waits for the uploads)."""
    sc = cluster.storage_class("cachefs-rollover-checkpoints", f"s3://{BUCKET}/rollover", writable=True,
                               source=REPO / "deploy" / "examples" / "checkpoints.yaml")
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                   "metadata": {"name": "rollover-ckpt", "namespace": "default"},
                   "spec": {"storageClassName": sc["metadata"]["name"], "accessModes": ["ReadWriteMany"],
                            "resources": {"requests": {"storage": "1Gi"}}}})
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rollover-writer", "namespace": "default"},
                   "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
                            "securityContext": {"fsGroup": 1000, "runAsUser": 1000},  # (as the example job)
                            "containers": [{"name": "writer", "image": IMAGE, "imagePullPolicy": "Never",
                                            "command": ["python3", "-c", WRITE_STEPS, "/ckpt/run-1", "40", "0.4"],
                                            "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}],
                            "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "rollover-ckpt"}}]}})
    cluster.wait(lambda: "started" in cluster.kubectl("logs", "rollover-writer", check=False), "writer writing", 180)
    time.sleep(3)
    before = node_pod(cluster)["metadata"]["name"]
    cluster.kubectl("rollout", "restart", "daemonset/cachefs-node", "-n", "cachefs-system")
    written = reader_result(cluster, "rollover-writer")
    cluster.wait_rollout("daemonset", "cachefs-node")
    cluster.delete_pod("rollover-writer")  # (its unpublish waits for the uploads)
    keys = {o["Key"] for o in cluster.s3_client.list_objects_v2(Bucket=BUCKET, Prefix="rollover/run-1/")
            .get("Contents", [])}
    missing = [rel for rel in written["files"] if f"rollover/run-1/{rel}" not in keys]
    wrong = [rel for rel, want in written["files"].items() if f"rollover/run-1/{rel}" in keys and digest(
        cluster.s3_client.get_object(Bucket=BUCKET, Key=f"rollover/run-1/{rel}")["Body"].read()) != want]
    REPORT["checkpoints while the node pod is replaced"] = (
        f"errors {len(written['errors'])}, files {len(written['files'])}, missing on the origin {len(missing)}, "
        f"wrong {len(wrong)}, longest step {written['max_op_s']:.1f} s")
    assert node_pod(cluster)["metadata"]["name"] != before
    assert written["errors"] == [] and len(written["files"]) == 80
    assert missing == [] and wrong == [], (missing[:5], wrong[:5])
    assert not any(".tmp" in k for k in keys), sorted(keys)[:10]


def test_a_pod_deleted_while_it_reads_leaves_nothing_and_its_neighbour_reads_on(cluster):
    url, want = cold_dataset(cluster, "pod-deleted")
    start_reader(cluster, "pod-deleted-neighbour", url, want, pace=0.08)
    start_reader(cluster, "pod-deleted", url, want)
    uid = cluster.get("pod", "pod-deleted")["metadata"]["uid"]
    cluster.delete_pod("pod-deleted")
    assert not [m for m in mounts_under(f"/var/lib/kubelet/pods/{uid}")], "the deleted pod's mounts outlived it"
    # kubelet removes the pod's directory in its housekeeping, once every volume is unmounted
    cluster.wait(lambda: not os.path.exists(f"/var/lib/kubelet/pods/{uid}"), "the pod's directory removed", 120)
    result = reader_result(cluster, "pod-deleted-neighbour")
    neighbour = cluster.get("pod", "pod-deleted-neighbour")["metadata"]["uid"]
    cluster.delete_pod("pod-deleted-neighbour")
    # (as run_fault: kubelet unmounts a deleted pod's volumes in its housekeeping; one still there after it is left)
    cluster.wait(lambda: not os.path.exists(f"/var/lib/kubelet/pods/{neighbour}"), "the neighbour's directory removed",
                 120)
    result["left_mounted"] = [m for m in mounts_under("/var/lib/kubelet/pods") if "kubernetes.io~csi" in m]
    result["stale"] = stale_mounts()
    REPORT["pod-deleted (its neighbour)"] = (f"errors {result['errors']}, wrong {result['wrong']}, longest wait "
                                             f"{result['max_wait_s']:.1f} s")
    assert_unharmed(result)


def test_a_full_cache_disk_under_a_reading_pod(cluster):
    ballast = os.path.join(CACHE_DIR, "ballast")

    def fill() -> None:
        chunk = b"\0" * (1 << 20)
        with open(ballast, "wb", buffering=0) as f:  # (unbuffered: nothing left to flush, and fail, at close)
            try:
                while f.write(chunk):
                    pass
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        REPORT["cache-full: free bytes left on the cache disk"] = str(os.statvfs(CACHE_DIR).f_bavail * 4096)

    try:
        result = run_fault(cluster, "cache-full", fill)
    finally:
        if os.path.exists(ballast):
            os.unlink(ballast)
    assert_unharmed(result)


@pytest.fixture(autouse=True)
def _cleanup_configmaps(cluster):
    yield
    cluster.kubectl("delete", "configmap", "-l", "cachefs-test=want", "-n", "default", "--ignore-not-found", check=False)

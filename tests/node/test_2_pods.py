"""Pods on the node reading and writing through cachefs volumes, every byte checked against the origin."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from cachefs.base.types import dataset_id
from tests.e2e.controlplane import REPO

from .cluster import NODE_NAME, mounts_under
from .conftest import TIMES
from .harness import BUCKET, DATASET_PREFIX, IMAGE, digest, last_json, reader_pod

DATASET_URL = f"s3://{BUCKET}/{DATASET_PREFIX}"


def docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def expected(cluster, under: str = "") -> dict[str, str]:
    return {rel[len(under):]: digest(data) for rel, data in cluster.dataset.items() if rel.startswith(under)}


def origin_gets(cluster) -> int:
    return sum(cluster.s3.requests()["gets"].values())


@pytest.fixture(scope="module")
def example_class(cluster):
    """deploy/base's example StorageClass, edited as README says (the dataset's endpoint and credentials)."""
    return cluster.storage_class("cachefs-example", DATASET_URL)


def claim(name: str, storage_class: str, modes=("ReadOnlyMany",)) -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": "default"},
            "spec": {"storageClassName": storage_class, "accessModes": list(modes),
                     "resources": {"requests": {"storage": "1Gi"}}}}


def run_to_completion(cluster, pod: dict, timeout: float = 240) -> dict:
    cluster.apply(pod)
    name = pod["metadata"]["name"]
    phase = cluster.wait_pod(name, ("Succeeded", "Failed"), timeout=timeout)
    out = cluster.logs(name)
    assert phase == "Succeeded", f"pod {name} {phase}: {out[-3000:]}\n{cluster.describe_failure()}"
    return last_json(out)


def test_a_pvc_of_the_example_class_reads_the_dataset_and_a_second_pod_starts_warm(cluster, example_class):
    cluster.apply(claim("imagenet-a", "cachefs-example"))
    volume = {"persistentVolumeClaim": {"claimName": "imagenet-a", "readOnly": True}}
    first = reader_pod("reader-1", volume)
    t0 = time.monotonic()
    cluster.apply(first)
    cluster.wait(lambda: cluster.get("pvc", "imagenet-a")["status"].get("phase") == "Bound", "claim bound", 120,
                 interval=0.1)
    TIMES["PVC bound (pod created → claim Bound)"] = time.monotonic() - t0
    cluster.wait(lambda: cluster.pod_phase("reader-1") in ("Running", "Succeeded", "Failed"), "reader-1 started", 180,
                 interval=0.1)
    TIMES["pod Running (pod created → Running)"] = time.monotonic() - t0
    assert cluster.wait_pod("reader-1", ("Succeeded", "Failed")) == "Succeeded", cluster.logs("reader-1")
    result = last_json(cluster.logs("reader-1"))
    TIMES["first byte read in the pod (walk, then open and read)"] = result["first_byte_s"]
    assert result["files"] == expected(cluster)
    pv = cluster.get("pv", cluster.get("pvc", "imagenet-a")["spec"]["volumeName"])
    assert pv["spec"]["csi"]["driver"] == "csi.cachefs.io"

    cluster.s3.requests(reset=True)
    second = run_to_completion(cluster, reader_pod("reader-2", volume))
    assert second["files"] == expected(cluster)
    assert origin_gets(cluster) == 0, "the second pod of the node should read the dataset from the node's cache"
    # one FUSE session of the dataset on the node, shared by both pods
    sessions = [m for m in mounts_under("/var/lib/cachefs/csi/sessions") if m.endswith("/mnt")]
    assert len(sessions) == 1, sessions
    for name in ("reader-1", "reader-2"):
        cluster.delete_pod(name)
    assert not [m for m in mounts_under("/var/lib/kubelet/pods") if "csi" in m], "a bind mount outlived its pod"


def test_the_nodes_locality_label_appears_after_a_pod_read(cluster, example_class):
    key = f"ds.cachefs.io/{dataset_id(DATASET_URL)}"
    labels = cluster.wait(lambda: (lab := cluster.get("node", NODE_NAME)["metadata"]["labels"]).get(key) and lab,
                          f"node label {key}", 90)
    assert labels[key] == "100"  # the whole dataset was read (test above, or the pods of this one)
    annotation = json.loads(cluster.get("node", NODE_NAME)["metadata"]["annotations"][key])
    assert annotation["url"] == DATASET_URL
    assert annotation["cachedBytes"] == annotation["totalBytes"] == sum(map(len, cluster.dataset.values()))


def inline_volume(cluster, **attributes) -> dict:
    return {"csi": {"driver": "csi.cachefs.io", "readOnly": True,
                    "volumeAttributes": {"url": DATASET_URL, "endpointUrl": cluster.s3.endpoint,
                                         "region": "us-east-1", **attributes},
                    "nodePublishSecretRef": {"name": "dataset-credentials"}}}


STAT_AND_READ = r"""
import json, os, sys
root = sys.argv[1]; out = {"refused": 0, "read": 0, "modes": set(), "groups": set(), "uid": os.getuid(),
                           "gids": sorted(os.getgroups()), "listing": "ok", "direct": "ok"}
try:
    os.listdir(root)
except PermissionError:
    out["listing"] = "refused"
try:
    open(os.path.join(root, sys.argv[2]), "rb").read()
except PermissionError:
    out["direct"] = "refused"
for d, _, files in os.walk(root):
    for name in files:
        p = os.path.join(d, name); st = os.stat(p)
        out["modes"].add(oct(st.st_mode & 0o777)); out["groups"].add(st.st_gid)
        try:
            open(p, "rb").read(); out["read"] += 1
        except PermissionError:
            out["refused"] += 1
print(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}), flush=True)
"""


def test_an_inline_volume_for_a_non_root_pod_with_an_fsgroup_and_a_pod_of_another_group_refused(cluster):
    ours = run_to_completion(cluster, reader_pod(
        "fsgroup-reader", inline_volume(cluster), security={"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000}))
    assert ours["files"] == expected(cluster)
    some_file = sorted(cluster.dataset)[0]
    mine = run_to_completion(cluster, reader_pod(
        "fsgroup-stat", inline_volume(cluster), script=STAT_AND_READ, args=("/data", some_file),
        security={"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000}))
    assert (mine["uid"], mine["modes"], mine["groups"]) == (1000, ["0o440"], [2000])
    assert mine["read"] == len(cluster.dataset) and mine["refused"] == 0
    assert (mine["listing"], mine["direct"]) == ("ok", "ok")
    # A volume for one group (mode 0440, root's group without an fsGroup): a pod whose user is in no such group is
    # refused, at the listing and at a direct open alike.
    other = run_to_completion(cluster, reader_pod(
        "other-group", inline_volume(cluster, mode="0440"), script=STAT_AND_READ, args=("/data", some_file),
        security={"runAsUser": 1001, "runAsGroup": 3000}))
    assert other["gids"] == [3000]
    assert (other["listing"], other["direct"], other["read"]) == ("refused", "refused", 0)
    for name in ("fsgroup-reader", "fsgroup-stat", "other-group"):
        cluster.delete_pod(name)


WRITE_CHECKPOINT = r"""
import hashlib, json, os, sys
run = sys.argv[1]; step = os.path.join(run, "step-100")
os.makedirs(step + ".tmp")
out = {}
for name, size in (("__0_0.distcp", 12_000_000), ("__1_0.distcp", 7_654_321), (".metadata", 4_321)):
    data = os.urandom(size)
    with open(os.path.join(step + ".tmp", name), "wb") as f:
        f.write(data)
        f.flush(); os.fsync(f.fileno())
    out[name] = hashlib.sha256(data).hexdigest()
os.rename(step + ".tmp", step)
st = os.stat(step)
print(json.dumps({"files": out, "gid": st.st_gid}), flush=True)
"""

READ_CHECKPOINT = r"""
import hashlib, json, os, sys
step = sys.argv[1]
print(json.dumps({"files": {n: hashlib.sha256(open(os.path.join(step, n), "rb").read()).hexdigest()
                            for n in sorted(os.listdir(step))}}), flush=True)
"""


def test_a_checkpoint_pvc_writes_renames_uploads_at_pod_deletion_and_reads_back(cluster):
    example = REPO / "deploy" / "examples" / "checkpoints.yaml"
    sc = cluster.storage_class("cachefs-checkpoints", f"s3://{BUCKET}/checkpoints", writable=True, source=example)
    assert sc["parameters"]["writable"] == "true"
    (pvc,) = [d for d in docs(example) if d["kind"] == "PersistentVolumeClaim"]
    cluster.apply(pvc)
    (job,) = [d for d in docs(example) if d["kind"] == "Job"]
    security = job["spec"]["template"]["spec"]["securityContext"]  # fsGroup 1000, as the example job runs
    volume = {"persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}}
    writer = reader_pod("ckpt-writer", volume, mount="/ckpt", script=WRITE_CHECKPOINT, args=("/ckpt/run-17",),
                        security={**security, "runAsUser": 1000}, read_only=False)
    written = run_to_completion(cluster, writer)
    assert written["gid"] == 1000
    uid = cluster.get("pod", "ckpt-writer")["metadata"]["uid"]
    # Deleting the pod unpublishes its volume, which waits for the uploads (NodeUnpublishVolume).
    cluster.delete_pod("ckpt-writer")
    kubelet_said = [line for line in cluster.node.log("kubelet").splitlines() if uid in line][-15:]
    keys = {o["Key"]: o for o in cluster.s3_client.list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/run-17/")
            .get("Contents", [])}
    assert {f"checkpoints/run-17/step-100/{n}" for n in written["files"]} <= set(keys), (
        sorted(keys), kubelet_said, cluster.kubectl("logs", "-n", "cachefs-system", "daemonset/cachefs-node",
                                                    "-c", "csi", "--tail=40", check=False))
    for name, want in written["files"].items():
        body = cluster.s3_client.get_object(Bucket=BUCKET, Key=f"checkpoints/run-17/step-100/{name}")["Body"].read()
        assert digest(body) == want, name
    assert "checkpoints/run-17/.cachefs/commits/step-100.json" in keys, sorted(keys)
    assert not any(".tmp" in k for k in keys), sorted(keys)
    back = run_to_completion(cluster, reader_pod("ckpt-reader", volume, mount="/ckpt", script=READ_CHECKPOINT,
                                                 args=("/ckpt/run-17/step-100",), security=security))
    assert back["files"] == written["files"]
    cluster.delete_pod("ckpt-reader")


READ_TRAIN = r"""
import hashlib, json, os, sys
root = sys.argv[1]
out = {os.path.relpath(os.path.join(d, n), root): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
       for d, _, files in os.walk(root) for n in files}
print(json.dumps({"files": out, "rank": os.environ.get("JOB_COMPLETION_INDEX")}), flush=True)
"""


def test_the_example_training_job_runs_on_the_node_through_the_cachefs_scheduler(cluster, example_class):
    """deploy/examples/training-job.yaml as written, but for its training image and command (there is no
    PyTorch image here: the pods read the dataset and check it instead) and with the node's GPUs advertised
    as Kubernetes documents for extended resources. Its inline-volume shell pod (busybox, the node's own AWS
    settings) is left out."""
    cluster.kubectl("patch", "node", NODE_NAME, "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"capacity": {"nvidia.com/gpu": "32"}}}))
    cluster.wait(lambda: cluster.get("node", NODE_NAME)["status"]["allocatable"].get("nvidia.com/gpu") == "32",
                 "32 GPUs allocatable", 60)
    objs = [d for d in docs(REPO / "deploy" / "examples" / "training-job.yaml") if d["kind"] != "Pod"]
    (job,) = [d for d in objs if d["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    container.update(image=IMAGE, imagePullPolicy="Never", command=["python3", "-c", READ_TRAIN, "/data/train"])
    assert job["spec"]["template"]["spec"]["schedulerName"] == "cachefs"
    cluster.apply(*objs)
    cluster.wait(lambda: cluster.get("job", "resnet50")["status"].get("succeeded") == 4, "job resnet50 complete", 300)
    pods = json.loads(cluster.kubectl("get", "pods", "-l", "job-name=resnet50", "-o", "json"))["items"]
    assert len(pods) == 4
    want = expected(cluster, "train/")
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE_NAME and pod["spec"]["schedulerName"] == "cachefs"
        assert last_json(cluster.logs(pod["metadata"]["name"]))["files"] == want
    events = json.loads(cluster.kubectl("get", "events", "--field-selector", "reason=Scheduled", "-o", "json"))["items"]
    by_scheduler = {e["involvedObject"]["name"]: e.get("reportingComponent") or e["source"].get("component")
                    for e in events}
    assert {by_scheduler[p["metadata"]["name"]] for p in pods} == {"cachefs"}
    cluster.kubectl("delete", "job", "resnet50", "--wait=true", "--cascade=foreground", timeout=200)

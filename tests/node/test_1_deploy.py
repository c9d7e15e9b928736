"""deploy/ on a real node, applied with kubectl as README's "On Kubernetes" says (through the tier's overlays, which
change image names only): every cachefs pod Running and Ready, the CSI driver registered with kubelet."""

from __future__ import annotations

import json

import yaml

from tests.e2e.controlplane import REPO

from .cluster import NODE_NAME
from .harness import HERE


def _images_replaced(text: str, overlay: dict) -> str:
    for image in overlay["images"]:
        text = text.replace(f"image: {image['name']}:", f"image: {image['newName']}:")
    return text


def test_overlays_change_image_names_only(cluster):
    for part in ("base", "scheduler"):
        overlay = yaml.safe_load((HERE / "overlay" / part / "kustomization.yaml").read_text())
        assert set(overlay) == {"apiVersion", "kind", "resources", "images"}
        assert all(set(i) == {"name", "newName"} for i in overlay["images"])
        ours = cluster.kubectl("kustomize", str(HERE / "overlay" / part))
        theirs = cluster.kubectl("kustomize", str(REPO / "deploy" / part))
        assert ours == _images_replaced(theirs, overlay)


def test_cachefs_pods_run_and_the_driver_is_registered(cluster):
    pods = json.loads(cluster.kubectl("get", "pods", "-n", "cachefs-system", "-o", "json"))["items"]
    components = {}
    for pod in pods:
        name = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        ready = all(s["ready"] for s in pod["status"]["containerStatuses"])
        components.setdefault(name, []).append((pod["status"]["phase"], ready, pod["spec"]["nodeName"]))
    assert components["node"] == [("Running", True, NODE_NAME)]
    assert components["csi-controller"] == [("Running", True, NODE_NAME)] * 2
    assert components["scheduler"] == [("Running", True, NODE_NAME)]
    # registered by the node plugin itself: kubelet lists the driver on the node's CSINode
    csinode = cluster.get("csinode", NODE_NAME)
    assert [(d["name"], d["nodeID"]) for d in csinode["spec"]["drivers"]] == [("csi.cachefs.io", NODE_NAME)]
    assert "csi.cachefs.io" in cluster.node.log("kubelet")


#: Warnings a healthy deploy may raise here: this test cluster runs no DNS, and probes fail once while a pod starts.
EXPECTED_WARNINGS = {"MissingClusterDNS", "Unhealthy"}


def _kubelet_catching_up(event: dict) -> bool:
    """kubelet's own ConfigMap informer not yet synced when it first mounts a pod's ConfigMap volume (a node busy
    starting every pod at once); it retries and the pod starts. Not a defect of deploy/."""
    return event["reason"] == "FailedMount" and "failed to sync configmap cache" in event["message"]


def test_nothing_of_cachefs_warns(cluster):
    """Every Warning event about cachefs's own objects is a defect of deploy/ (one found this way: a
    PodDisruptionBudget over the DaemonSet's pods, which the disruption controller can never compute, since
    DaemonSets have no scale subresource, and which therefore refused every eviction of a node pod)."""
    events = json.loads(cluster.kubectl("get", "events", "-n", "cachefs-system", "-o", "json"))["items"]
    warnings = [f"{e['involvedObject']['kind']}/{e['involvedObject']['name']}: {e['reason']}: {e['message']}"
                for e in events if e["type"] == "Warning" and e["reason"] not in EXPECTED_WARNINGS
                and not _kubelet_catching_up(e)]
    assert warnings == []

"""deploy/ as a platform team would apply it: every manifest is created on the real API server with strict
field validation (unknown or misplaced fields are refused), the kustomization lists every file, and the
example job's objects are accepted as written."""

from __future__ import annotations

import urllib.error

import pytest
import yaml

from .controlplane import REPO, collection_path

BASE = REPO / "deploy" / "base"
#: Applied by the session fixture already (the extender needs them).
APPLIED = {"namespace.yaml", "rbac-node-agent.yaml", "node-agent-own-node.yaml", "rbac-scheduler-extender.yaml"}


def docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}


def delete_all(k8s, objs) -> None:
    """Remove what a test created, so the scheduling tests see the cluster as their fixture made it."""
    for d in reversed(objs):
        try:
            k8s.request("DELETE", f"{collection_path(d)}/{d['metadata']['name']}")
        except urllib.error.HTTPError as exc:
            exc.close()


def test_base_manifests_are_accepted_as_written(k8s):
    objs = [d for path in sorted(BASE.glob("*.yaml")) if path.name not in APPLIED | {"kustomization.yaml"}
            for d in docs(path)]
    try:
        k8s.apply(*objs)
        check_base(k8s)
    finally:
        delete_all(k8s, objs)


def check_base(k8s) -> None:
    driver = k8s.request("GET", "/apis/storage.k8s.io/v1/csidrivers/csi.cachefs.io")
    assert driver["spec"]["attachRequired"] is False and driver["spec"]["podInfoOnMount"] is True
    assert set(driver["spec"]["volumeLifecycleModes"]) == {"Persistent", "Ephemeral"}
    ds = k8s.request("GET", "/apis/apps/v1/namespaces/cachefs-system/daemonsets/cachefs-node")
    mounts = {m["name"]: m for c in ds["spec"]["template"]["spec"]["containers"] for m in c.get("volumeMounts", [])}
    assert mounts["pods-dir"]["mountPropagation"] == "Bidirectional"
    sc = k8s.request("GET", "/apis/storage.k8s.io/v1/storageclasses/cachefs-example")
    assert sc["provisioner"] == "csi.cachefs.io"
    (mounter,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "mounter"]
    assert mounter["lifecycle"]["preStop"]["exec"]["command"][:2] == ["cachefs", "sync"]  # uploads drain first


def test_example_training_job_is_accepted(k8s):
    # In a namespace of its own: without kube-controller-manager a deleted claim keeps its protection
    # finalizer forever, and the scheduling tests use a claim of the same name in "default".
    k8s.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "deploy-example"}})
    objs = docs(REPO / "deploy" / "examples" / "training-job.yaml")
    for d in objs:
        d["metadata"]["namespace"] = "deploy-example"
    try:
        k8s.apply(*objs)
        job = k8s.request("GET", "/apis/batch/v1/namespaces/deploy-example/jobs/resnet50")
        assert job["spec"]["template"]["spec"]["schedulerName"] == "cachefs"
    finally:
        delete_all(k8s, objs)


def test_example_checkpoint_volume_is_accepted(k8s):
    k8s.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "deploy-ckpt"}})
    objs = docs(REPO / "deploy" / "examples" / "checkpoints.yaml")
    for d in objs:
        if d["kind"] != "StorageClass":
            d["metadata"]["namespace"] = "deploy-ckpt"
    try:
        k8s.apply(*objs)
        sc = k8s.request("GET", "/apis/storage.k8s.io/v1/storageclasses/cachefs-checkpoints")
        assert sc["parameters"]["writable"] == "true"
        pvc = k8s.request("GET", "/api/v1/namespaces/deploy-ckpt/persistentvolumeclaims/run-17-checkpoints")
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    finally:
        delete_all(k8s, objs)


def test_strict_validation_refuses_a_typo(k8s):
    bad = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "typo"},
           "provisioner": "csi.cachefs.io", "parameter": {"url": "s3://x/y"}}
    with pytest.raises(urllib.error.HTTPError) as exc:
        k8s.apply(bad)
    exc.value.close()
    assert exc.value.code in (400, 422)


def test_second_scheduler_manifests_are_accepted(k8s):
    sched = REPO / "deploy" / "scheduler"
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cachefs-scheduler-config",
              "namespace": "cachefs-system"},  # what the kustomization's configMapGenerator makes
              "data": {"kube-scheduler-config.yaml": (sched / "kube-scheduler-config.yaml").read_text()}}
    objs = [config, *docs(sched / "second-scheduler.yaml")]
    try:
        k8s.apply(*objs)
        dep = k8s.request("GET", "/apis/apps/v1/namespaces/cachefs-system/deployments/cachefs-scheduler")
        assert dep["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == config["metadata"]["name"]
        # the extender is a sidecar that listens on loopback, where kube-scheduler's config points
        (extender,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "extender"]
        listen = extender["args"][extender["args"].index("--listen") + 1]
        sched = yaml.safe_load(config["data"]["kube-scheduler-config.yaml"])
        assert listen.startswith("127.0.0.1:") and sched["extenders"][0]["urlPrefix"] == f"http://{listen}"
        assert all(p.get("containerPort") != int(listen.split(":")[1])
                   for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", []))
    finally:
        delete_all(k8s, objs)


def test_monitoring_scrapes_the_ports_the_pods_expose_and_the_dashboard_uses_known_metrics():
    """deploy/monitoring: the PodMonitor selects the node and extender pods by their labels and scrapes a port they
    name `metrics` (prometheus-operator's CRD is not on the test API server, so this is checked here); every metric
    the dashboard queries is one docs/METRICS.md lists."""
    import json
    import re

    (pm,) = docs(REPO / "deploy" / "monitoring" / "podmonitor.yaml")
    pods = {}
    for path in (BASE / "node-daemonset.yaml", REPO / "deploy" / "scheduler" / "second-scheduler.yaml"):
        for d in docs(path):
            if d["kind"] in ("DaemonSet", "Deployment"):
                pods[d["metadata"]["name"]] = d["spec"]["template"]
    components = pm["spec"]["selector"]["matchExpressions"][0]["values"]
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    for template in pods.values():
        labels = template["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/component"] in components
        assert any(p.get("name") == port for c in template["spec"]["containers"] for p in c.get("ports", []))
    dash = json.loads((REPO / "deploy" / "monitoring" / "grafana-dashboard.json").read_text())
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for p in dash["panels"] for t in p["targets"]
            for n in re.findall(r"cachefs_[a-z_]+", t["expr"])}
    listed = set(re.findall(r"`(cachefs_[a-z_]+)`", (REPO / "docs" / "METRICS.md").read_text()))
    assert used and used <= listed, used - listed

"""End to end on a real control plane: the publisher under deploy/'s RBAC and admission policy, and the
extender inside a real kube-scheduler (locality via PVCs, ignorable when down, gangs with topology and
without deadlock, responses the scheduler accepts)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from cachefs.base.types import dataset_id
from cachefs.kube import ApiError, KubeClient, KubeConfig
from cachefs.testing import waiting
from scheduler_hints.labels import DatasetCache, NodeCacheSummary, dataset_key, desired_metadata
from scheduler_hints.publisher import Publisher
from scheduler_hints.summary import StaticSummary

from .controlplane import EXTENDER_TOPOLOGY_WAIT

pytestmark = pytest.mark.slow


def wait_for(check, timeout: float = 60.0, what: str = "condition"):
    return waiting.wait_for(check, timeout, what, interval=0.25)


def make_node(k8s, name: str, *, gpus: int = 0, labels: dict[str, str] | None = None) -> None:
    k8s.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, **(labels or {})}}})
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    k8s.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": {
        "capacity": resources, "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}]}},
                content_type="application/merge-patch+json")


def make_pod(name: str, *, ns: str = "default", gpus: int = 0, selector: dict[str, str] | None = None,
             annotations: dict[str, str] | None = None, claim: str | None = None, node: str | None = None,
             service_account: str | None = None, scheduler: str = "cachefs") -> dict:
    res = {"cpu": "100m"}
    if gpus:
        res["nvidia.com/gpu"] = str(gpus)
    spec: dict = {"schedulerName": scheduler, "containers": [{"name": "c", "image": "busybox",
                                                              "resources": {"requests": res, "limits": res}}]}
    if selector:
        spec["nodeSelector"] = selector
    if claim:
        spec["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}]
        spec["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    if node:
        spec["nodeName"] = node
    if service_account:
        spec["serviceAccountName"] = service_account
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": annotations or {}}, "spec": spec}


def node_of(k8s, name: str, ns: str = "default") -> str | None:
    return (k8s.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}").get("spec") or {}).get("nodeName")


def delete_pod(k8s, name: str, ns: str = "default") -> None:
    # No kubelet confirms termination here, so delete at once (grace 0), as a node's kubelet would after stop.
    k8s.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}?gracePeriodSeconds=0")


def node_labels(k8s, name: str) -> dict[str, str]:
    return k8s.request("GET", f"/api/v1/nodes/{name}")["metadata"].get("labels") or {}


URL = "s3://e2e-bucket/imagenet"
DS = dataset_id(URL)


def summary(cached: int, total: int = 1000) -> NodeCacheSummary:
    return NodeCacheSummary((DatasetCache(URL, DS, cached, total, 1),) if cached else (), 50 * 2**30, 100 * 2**30,
                            50 * 2**30, "rack-1")


def test_publisher_writes_only_its_own_node_under_shipped_rbac(k8s, tmp_path):
    make_node(k8s, "pub-a")
    make_node(k8s, "pub-b")
    # What kubelet mounts into the node agent: a service-account token bound to its pod on pub-a.
    k8s.apply(make_pod("agent-a", ns="cachefs-system", node="pub-a", service_account="cachefs-node"))
    uid = k8s.request("GET", "/api/v1/namespaces/cachefs-system/pods/agent-a")["metadata"]["uid"]
    token = k8s.request("POST", "/api/v1/namespaces/cachefs-system/serviceaccounts/cachefs-node/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600, "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                                               "name": "agent-a", "uid": uid}}})["status"]["token"]

    async def scenario():
        client = KubeClient(KubeConfig(k8s.server, token=token, insecure=True))
        source = StaticSummary(summary(420))
        pub = Publisher(client, "pub-a", source, min_interval=0)
        try:
            first = await pub.publish_once()
            assert first.patched and dataset_key(DS) in first.labels_changed
            assert node_labels(k8s, "pub-a")[dataset_key(DS)] == "40"
            assert node_labels(k8s, "pub-a")["cachefs.io/cache-group"] == "rack-1"
            assert not (await pub.publish_once()).patched  # nothing changed: no write
            source.current = summary(905)
            await pub.publish_once()
            assert node_labels(k8s, "pub-a")[dataset_key(DS)] == "90"
            source.current = summary(0)  # dataset evicted: its label and annotation go
            gone = await pub.publish_once()
            assert dataset_key(DS) in gone.labels_removed
            node = k8s.request("GET", "/api/v1/nodes/pub-a")["metadata"]
            assert dataset_key(DS) not in node["labels"] and dataset_key(DS) not in node.get("annotations", {})
            # The same credentials on another node: refused by the shipped admission policy, once the API server
            # enforces it (it loads policies in the background: a dry run, which policies judge, says when).
            async def policy_enforced() -> bool:
                try:
                    await client.request("PATCH", "/api/v1/nodes/pub-b", {"metadata": {"labels": {"probe": "x"}}},
                                         content_type="application/merge-patch+json", params={"dryRun": "All"})
                except ApiError as exc:
                    return exc.status == 403
                return False

            deadline = time.monotonic() + 60
            while not await policy_enforced():
                assert time.monotonic() < deadline, "the node-agent admission policy was never enforced"
                await asyncio.sleep(0.25)
            with pytest.raises(ApiError) as refused:
                await Publisher(client, "pub-b", StaticSummary(summary(500)), min_interval=0).publish_once()
            assert refused.value.status == 403 and "only change the Node it runs on" in refused.value.message
            assert dataset_key(DS) not in node_labels(k8s, "pub-b")
            # And RBAC grants nothing beyond nodes get/patch.
            with pytest.raises(ApiError) as denied:
                await client.get("/api/v1/pods")
            assert denied.value.status == 403
        finally:
            await client.aclose()

    asyncio.run(scenario())

    # The node agent's CLI, publishing from a real (empty) cache index with that token.
    kubeconfig = tmp_path / "agent.kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": k8s.server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "publish-labels", "--once", "--node", "pub-a",
                          "--kubeconfig", str(kubeconfig), "--cache-dir", str(tmp_path / "cache"),
                          "--cache-group", "rack-2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["patched"] is True
    assert node_labels(k8s, "pub-a")["cachefs.io/cache-group"] == "rack-2"
    other = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "publish-labels", "--once", "--node", "pub-b",
                            "--kubeconfig", str(kubeconfig), "--cache-dir", str(tmp_path / "cache")],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and "403" in other.stderr and "Traceback" not in other.stderr


def label_node(k8s, name: str, cached: int, total: int) -> None:
    labels, annotations = desired_metadata(NodeCacheSummary((DatasetCache(URL, DS, cached, total, 1),), 0, 0, 0))
    k8s.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": labels, "annotations": annotations}},
                content_type="application/merge-patch+json")


def test_pod_lands_where_its_pvc_dataset_is_cached_and_schedules_with_extender_down(k8s):
    sel = {"e2e": "locality"}
    make_node(k8s, "loc-a", labels=sel)
    make_node(k8s, "loc-b", labels=sel)
    label_node(k8s, "loc-a", 900 * 2**30, 1000 * 2**30)
    label_node(k8s, "loc-b", 100 * 2**30, 1000 * 2**30)
    k8s.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "imagenet-pv"}, "spec": {
        "capacity": {"storage": "1Ti"}, "accessModes": ["ReadOnlyMany"], "persistentVolumeReclaimPolicy": "Retain",
        "storageClassName": "", "claimRef": {"namespace": "default", "name": "imagenet"},
        "csi": {"driver": "csi.cachefs.io", "volumeHandle": "imagenet", "volumeAttributes": {"url": URL}}}})
    # No kube-controller-manager runs here, so the claim is created already bound, as its PV controller leaves it.
    k8s.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {
        "name": "imagenet", "namespace": "default", "annotations": {"pv.kubernetes.io/bind-completed": "yes"}},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": "imagenet-pv",
                 "resources": {"requests": {"storage": "1Ti"}}}})
    k8s.request("PATCH", "/api/v1/persistentvolumes/imagenet-pv/status", {"status": {"phase": "Bound"}},
                content_type="application/merge-patch+json")
    k8s.request("PATCH", "/api/v1/namespaces/default/persistentvolumeclaims/imagenet/status",
                {"status": {"phase": "Bound", "accessModes": ["ReadOnlyMany"], "capacity": {"storage": "1Ti"}}},
                content_type="application/merge-patch+json")
    time.sleep(1)  # let the extender's watches see the PV, PVC and labels
    for i in range(3):
        k8s.apply(make_pod(f"train-{i}", selector=sel, claim="imagenet"))
    for i in range(3):
        assert wait_for(lambda i=i: node_of(k8s, f"train-{i}"), 60, f"train-{i} bound") == "loc-a"

    k8s.procs["extender"].stop()
    try:
        k8s.apply(make_pod("train-ext-down", selector=sel, claim="imagenet"))
        assert wait_for(lambda: node_of(k8s, "train-ext-down"), 60, "a pod bound with the extender down") in (
            "loc-a", "loc-b")
    finally:
        k8s.start_extender()


def test_a_pod_goes_to_the_cache_group_holding_its_dataset_over_a_node_holding_more_itself(k8s):
    """Group a's two nodes hold 25 % of the dataset each, and publish that their group holds 95 % (the other
    members' shares: docs/LABELS.md); node b holds 35 % alone. Reading from a peer beats the origin, so the pods
    go to group a. (Adding up only a's two labelled nodes, 50 %, would have sent them to b.)"""
    sel = {"e2e": "group"}
    url = "s3://e2e-bucket/group-sharded"  # (a dataset no other test's nodes hold: nothing to wait for elsewhere)
    ds = dataset_id(url)
    for name, own, group, rack in (("grp-a1", 250, 950, "rack-ga"), ("grp-a2", 250, 950, "rack-ga"),
                                   ("grp-b1", 350, 350, "rack-gb")):
        make_node(k8s, name, labels=sel)
        labels, annotations = desired_metadata(NodeCacheSummary(
            (DatasetCache(url, ds, own * 2**30, 1000 * 2**30, 1),), 0, 0, 0, rack,
            group_datasets=(DatasetCache("", ds, group * 2**30, 1000 * 2**30),)))
        assert labels[f"group.cachefs.io/{ds}"] == str(group // 10)
        k8s.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": labels, "annotations": annotations}},
                    content_type="application/merge-patch+json")
    time.sleep(1)  # let the extender's node watch see the labels
    for i in range(2):
        k8s.apply(make_pod(f"grp-{i}", selector=sel, annotations={"cachefs.io/datasets": url}))
    for i in range(2):
        assert wait_for(lambda i=i: node_of(k8s, f"grp-{i}"), 60, f"grp-{i} bound") in ("grp-a1", "grp-a2")
    for i in range(2):
        delete_pod(k8s, f"grp-{i}")


GANG_NODES = {f"gpu-{i}": ("c1" if i < 3 else "c2", "leaf-1" if i < 3 else "leaf-2") for i in range(7)}


def gang_pod(name: str, gang: str, size: int = 4, gpus: int = 8) -> dict:
    pod = make_pod(name, gpus=gpus, selector={"e2e": "gang"},
                   annotations={"cachefs.io/gang": gang, "cachefs.io/gang-size": str(size)})
    pod["metadata"]["labels"] = {"e2e-gang": gang}
    return pod


def delete_gang_one_by_one(k8s, names: list[str], pause: float) -> None:
    """Delete a gang's pods one at a time with ``pause`` seconds between them, as a real cluster does (kubelets
    stop them one by one; the extender sees one watch event at a time)."""
    for i, name in enumerate(names):
        if i:
            time.sleep(pause)
        delete_pod(k8s, name)


def test_gangs_land_in_one_clique_and_never_deadlock(k8s):
    for name, (clique, leaf) in GANG_NODES.items():
        make_node(k8s, name, gpus=8, labels={"e2e": "gang", "nvidia.com/gpu.clique": clique,
                                             "network.topology.nvidia.com/block": leaf})
    time.sleep(1)
    # 3 nodes in clique c1, 4 in c2: a 4 × 8-GPU gang fits only in c2, and must land there whole.
    first = [f"ga-{i}" for i in range(4)]
    k8s.apply(*[gang_pod(p, "ga") for p in first])
    placed = [wait_for(lambda p=p: node_of(k8s, p), 90, f"{p} bound") for p in first]
    assert {GANG_NODES[n][0] for n in placed} == {"c2"} and len(set(placed)) == 4
    for p in first:
        delete_pod(k8s, p)
    wait_for(lambda: not any(k8s.request("GET", "/api/v1/namespaces/default/pods?fieldSelector=spec.nodeName%3D"
                                         + n)["items"] for n in GANG_NODES), 30, "gang ga gone")

    # Two 32-GPU gangs arrive together on 56 GPUs: exactly one runs whole, the other waits holding nothing.
    b = [f"gb-{i}" for i in range(4)]
    c = [f"gc-{i}" for i in range(4)]
    for i in range(4):  # interleaved arrival
        k8s.apply(gang_pod(b[i], "gb"), gang_pod(c[i], "gc"))

    def bound(names):
        return [n for n in names if node_of(k8s, n)]

    wait_for(lambda: len(bound(b)) == 4 or len(bound(c)) == 4, 120, "one gang bound whole")
    time.sleep(5)  # give a would-be partial second gang time to show up
    winner, loser = (b, c) if len(bound(b)) == 4 else (c, b)
    assert len(bound(winner)) == 4 and bound(loser) == []
    assert len({GANG_NODES[node_of(k8s, n)][0] for n in winner}) == 1  # one clique
    # kube-scheduler's last look at the waiting gang is now longer ago than the extender's topology wait; the
    # winner's pods then go one by one, the whole clique freed within that wait. The gang must wait for the clique,
    # not go across cliques as soon as the freed GPUs add up (it did, while its wait was timed from its last refusal).
    time.sleep(EXTENDER_TOPOLOGY_WAIT + 5)
    delete_gang_one_by_one(k8s, list(reversed(winner)), pause=2.0)
    wait_for(lambda: len(bound(loser)) == 4, 120, "the waiting gang bound after GPUs freed")
    assert len({GANG_NODES[node_of(k8s, n)][0] for n in loser}) == 1
    for p in loser:
        delete_pod(k8s, p)


def test_a_forged_bind_of_a_pod_the_extender_never_filtered_binds_nothing(k8s):
    """Another tenant's pending pod (left to a scheduler that does not run here) cannot be placed by posting
    to the extender's bind: it answers 403 and the pod stays unbound."""
    import urllib.error
    import urllib.request

    make_node(k8s, "forge-target", gpus=8)
    k8s.apply(make_pod("victim", scheduler="nobody"))
    uid = k8s.request("GET", "/api/v1/namespaces/default/pods/victim")["metadata"]["uid"]
    body = json.dumps({"PodName": "victim", "PodNamespace": "default", "PodUID": uid, "Node": "forge-target"})
    req = urllib.request.Request(f"http://127.0.0.1:{k8s.extender_port}/bind", data=body.encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 403 and "filter" in json.loads(refused.value.read())["Error"]
    refused.value.close()
    time.sleep(1)
    assert node_of(k8s, "victim") is None
    delete_pod(k8s, "victim")
    k8s.request("DELETE", "/api/v1/nodes/forge-target")


def test_scheduler_accepted_every_extender_response(k8s):
    """After the tests above, kube-scheduler logged no extender failure other than the deliberate outage."""
    def trouble_lines() -> list[str]:
        return [line for line in k8s.log("kube-scheduler").splitlines()
                if "Skipping extender" in line or "Failed to run extender" in line
                or ("extender" in line.lower() and " err=" in line)]

    def during_outage(line: str) -> bool:
        # The one pod scheduled while the extender was down. (How the failed calls read depends on the connection
        # kube-scheduler had: "connection refused" on a fresh one, EOF or a reset on a kept-alive one.)
        return 'pod="default/train-ext-down"' in line

    def outage_seen(lines: list[str]) -> bool:
        # (Which verbs kube-scheduler reports during the outage depends on where the pod's cycle was when the
        # extender went: the filter always, the bind only if it got that far while the extender was down.)
        return any(during_outage(line) and "/filter" in line for line in lines)

    # The outage in the locality test shows up (so these lines are what we think they are; kube-scheduler's log
    # reaches its file within klog's flush interval, 5 s; this test shares that test's control plane: one worker
    # runs every end-to-end file, tests/conftest.py) ...
    try:
        trouble = wait_for(lambda: (lines := trouble_lines()) and outage_seen(lines) and lines, 30,
                           "the extender outage in kube-scheduler's log")
    except AssertionError as e:
        raise AssertionError(f"{e}; extender lines: {trouble_lines()[:20]}") from None
    # ... and nothing else: every filter, prioritize and bind answer was accepted.
    bad = [line for line in trouble if not during_outage(line)]
    assert not bad, "\n".join(bad[:20])
    events = k8s.request("GET", "/api/v1/namespaces/default/events")["items"]
    assert not [e for e in events if "extender" in (e.get("message") or "").lower()
                and e.get("involvedObject", {}).get("name") != "train-ext-down"]


def test_extender_log_has_no_tracebacks(k8s):
    assert "Traceback" not in k8s.log("extender")


def test_a_pod_that_asks_for_warm_data_stays_pending_saying_why_until_its_node_holds_it(k8s):
    """`cachefs.io/wait-warm: "80"` through the real kube-scheduler: the pod's FailedScheduling event carries the
    extender's reason (how warm the best node is) and the pod binds once the node's labels say 90 %."""
    make_node(k8s, "warmwait-a", labels={"e2e": "warmwait"})
    label_node(k8s, "warmwait-a", 300 * 2**30, 1000 * 2**30)
    pod = make_pod("warmwait", selector={"e2e": "warmwait"},
                   annotations={"cachefs.io/datasets": URL, "cachefs.io/wait-warm": "80"})
    k8s.apply(pod)

    def said() -> str:
        events = k8s.request("GET", "/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3Dwarmwait")
        return " ".join(e.get("message", "") for e in events["items"] if e.get("reason") == "FailedScheduling")

    # (the first attempts may come before the extender's node watch saw the labels: kube-scheduler retries)
    message = wait_for(lambda: "30 percent cached in node warmwait-a" in (m := said()) and m, 60,
                       "a FailedScheduling event saying how warm the node is")
    assert "MISSING" not in message, message
    assert node_of(k8s, "warmwait") is None
    label_node(k8s, "warmwait-a", 900 * 2**30, 1000 * 2**30)
    # One change only (no warm-up publishing after it): kube-scheduler may try the pod again before the extender's
    # watch sees the new labels; refused again, it would wait for the next event, so the extender marks it
    # cachefs.io/warm-ready once it has seen them, and that update has it tried at once.
    def bound() -> str | None:
        return node_of(k8s, "warmwait")

    assert wait_for(bound, 60, "bound once warm") == "warmwait-a"
    delete_pod(k8s, "warmwait")
    k8s.request("DELETE", "/api/v1/nodes/warmwait-a")

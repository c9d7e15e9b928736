"""Gangs from queueing systems on the real control plane: a Kueue Workload (its CRDs as Kueue ships them, from
the Go module sigs.k8s.io/kueue; the objects written as Kueue writes them once it admitted the workload, since
Kueue's controller does not run here) and a KAI scheduler PodGroup (a CRD of the group, version and fields the
extender reads, ``scheduling.run.ai/v2alpha2`` PodGroup ``spec.minMember``). The size of each gang comes from that
object: the first members wait, none bound, until the last arrives; then all bind. deploy/'s Kueue example
(a Topology with the cache group as a level) is accepted by Kueue's own CRD schema.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from .controlplane import REPO
from .test_scheduling import delete_pod, make_node, make_pod, node_of, wait_for

pytestmark = pytest.mark.slow

KUEUE = "v0.17.0"
QUEUE_NODES = {"q-a1": "qa", "q-a2": "qa", "q-b1": "qb", "q-b2": "qb", "q-b3": "qb", "q-b4": "qb"}


def kueue_crds() -> Path:
    """Kueue's CRD manifests, from its Go module (downloaded into the module cache once)."""
    if shutil.which("go") is None:
        pytest.skip("the go command is needed to fetch Kueue's CRDs from its module")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["go", "mod", "download", "-json", f"sigs.k8s.io/kueue@{KUEUE}"], cwd=tmp,
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(json.loads(out.stdout)["Dir"]) / "config" / "components" / "crd" / "bases"


KAI_PODGROUP_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podgroups.scheduling.run.ai"},
    "spec": {"group": "scheduling.run.ai", "scope": "Namespaced",
             "names": {"kind": "PodGroup", "plural": "podgroups", "singular": "podgroup", "listKind": "PodGroupList"},
             "versions": [{"name": "v2alpha2", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {
                     "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                              "properties": {"minMember": {"type": "integer"}, "queue": {"type": "string"}}}}}}}]}}


def established(k8s, name: str) -> bool:
    crd = k8s.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    return any(c.get("type") == "Established" and c.get("status") == "True"
               for c in (crd.get("status") or {}).get("conditions") or [])


@pytest.fixture(scope="module")
def queues(k8s):
    crds = kueue_crds()
    for kind in ("workloads", "topologies", "resourceflavors"):
        doc = yaml.safe_load((crds / f"kueue.x-k8s.io_{kind}.yaml").read_text())
        k8s.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", doc)
    k8s.apply(KAI_PODGROUP_CRD)
    for name in ("workloads.kueue.x-k8s.io", "topologies.kueue.x-k8s.io", "resourceflavors.kueue.x-k8s.io",
                 "podgroups.scheduling.run.ai"):
        wait_for(lambda n=name: established(k8s, n), 60, f"CRD {name} established")
    for name, clique in QUEUE_NODES.items():
        make_node(k8s, name, gpus=8, labels={"e2e": "queue", "nvidia.com/gpu.clique": clique})
    # The extender looks for APIs that were not served when it started every 15 s.
    for path in ("/apis/kueue.x-k8s.io/v1beta2/workloads", "/apis/scheduling.run.ai/v2alpha2/podgroups"):
        wait_for(lambda p=path: f"watching {p}" in k8s.log("extender"), 60, f"the extender watching {path}")
    return k8s


def test_deploys_kueue_example_is_accepted_by_kueues_schema(queues):
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "examples" / "kueue-topology.yaml").read_text()) if d]
    queues.apply(*[d for d in docs if d["kind"] in ("Topology", "ResourceFlavor")])
    levels = queues.request("GET", "/apis/kueue.x-k8s.io/v1beta2/topologies/gpu-cachefs")["spec"]["levels"]
    assert {"nodeLabel": "cachefs.io/cache-group"} in levels


def gang_member(name: str, *, annotations: dict, labels: dict, selector: dict) -> dict:
    pod = make_pod(name, gpus=8, selector={"e2e": "queue", **selector}, annotations=annotations)
    pod["metadata"]["labels"] = labels
    return pod


def bound(k8s, names: list[str]) -> list[str]:
    return [n for n in names if node_of(k8s, n)]


def test_a_kueue_workloads_pods_wait_for_the_whole_workload_then_bind_in_the_domain_kueue_assigned(queues):
    k8s = queues
    k8s.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
               "metadata": {"name": "job-train-5d1e2", "namespace": "default"},
               "spec": {"queueName": "gpus", "podSets": [{"name": "main", "count": 4, "template": {"spec": {
                   "containers": [{"name": "c", "image": "busybox",
                                   "resources": {"requests": {"nvidia.com/gpu": "8"}}}]}}}]}})
    names = [f"kw-{i}" for i in range(4)]
    # As Kueue's topology-aware scheduling leaves them: the workload's name, the pod set, the tas label, and the
    # domain it assigned (clique qb) in the node selector.
    pods = [gang_member(n, annotations={"kueue.x-k8s.io/workload": "job-train-5d1e2"},
                        labels={"kueue.x-k8s.io/podset": "main", "kueue.x-k8s.io/tas": "true"},
                        selector={"nvidia.com/gpu.clique": "qb"}) for n in names]
    k8s.apply(*pods[:3])
    time.sleep(4)
    assert bound(k8s, names[:3]) == []  # three of four: they wait for the workload's fourth pod
    k8s.apply(pods[3])
    placed = [wait_for(lambda n=n: node_of(k8s, n), 60, f"{n} bound") for n in names]
    assert {QUEUE_NODES[n] for n in placed} == {"qb"} and len(set(placed)) == 4
    for n in names:
        delete_pod(k8s, n)


def test_a_kai_pod_groups_members_wait_for_min_member_then_bind(queues):
    k8s = queues
    k8s.apply({"apiVersion": "scheduling.run.ai/v2alpha2", "kind": "PodGroup",
               "metadata": {"name": "kai-train", "namespace": "default"}, "spec": {"minMember": 3, "queue": "team"}})
    names = [f"kai-{i}" for i in range(3)]
    pods = [gang_member(n, annotations={"pod-group-name": "kai-train"}, labels={}, selector={}) for n in names]
    k8s.apply(*pods[:2])
    time.sleep(4)
    assert bound(k8s, names[:2]) == []
    k8s.apply(pods[2])
    placed = [wait_for(lambda n=n: node_of(k8s, n), 60, f"{n} bound") for n in names]
    assert len({QUEUE_NODES[n] for n in placed}) == 1  # one clique
    for n in names:
        delete_pod(k8s, n)

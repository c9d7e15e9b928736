"""GPUs by Dynamic Resource Allocation on the real control plane: kube-scheduler's own DynamicResources plugin
allocates the devices a DRA driver publishes, the extender admits gangs and packs them by topology from the same
ResourceSlices (cliques known only from device attributes), and a cluster may mix DRA nodes with nodes whose GPUs
are the ``nvidia.com/gpu`` extended resource.

No kubelet or DRA driver runs here: the test publishes ResourceSlices as NVIDIA's driver does.
kube-controller-manager's resourceclaim controller makes each pod's ResourceClaim from its template, and its garbage
collector deletes the claim after the pod.
"""

from __future__ import annotations

import time
import urllib.error

import pytest

from .test_scheduling import delete_pod, make_node, make_pod, node_of, wait_for

pytestmark = pytest.mark.slow

DRIVER = "gpu.nvidia.com"
#: Seven DRA nodes of 8 GPUs: three in NVLink clique c1, four in c2 (as the extended-resource gang test).
DRA_NODES = {**{f"dra-a{i}": "c1" for i in range(1, 4)}, **{f"dra-b{i}": "c2" for i in range(1, 5)}}


def gpu_slice(node: str, clique: str, gpus: int = 8) -> dict:
    """A ResourceSlice as NVIDIA's DRA driver publishes one per node (attributes trimmed to what matters)."""
    devices = [{"name": f"gpu-{i}", "attributes": {
        "type": {"string": "gpu"}, "index": {"int": i}, "productName": {"string": "NVIDIA H200"},
        "cliqueId": {"string": clique}, "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{i // 4:02x}"}},
        "capacity": {"memory": {"value": "141Gi"}}} for i in range(gpus)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpus"},
            "spec": {"driver": DRIVER, "nodeName": node, "devices": devices,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}}


@pytest.fixture(scope="module")
def dra(k8s):
    k8s.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DRIVER},
               "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}},
              *({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                 "metadata": {"name": name, "namespace": "default"},
                 "spec": {"spec": {"devices": {"requests": [
                     {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": count}}]}}}}
                for name, count in (("eight-gpus", 8), ("one-gpu", 1))))
    for name, clique in DRA_NODES.items():
        make_node(k8s, name, labels={"e2e": "dra"})  # no clique label: the devices carry it
        k8s.apply(gpu_slice(name, clique))
    time.sleep(1)
    return k8s


@pytest.fixture(autouse=True)
def no_pods_left(dra):
    """Whatever a test leaves (a failure skips its own clean-up) is deleted with its claims before the next one:
    GPUs held by one test's pods would fail the next for a reason of its own."""
    yield
    pods = [p["metadata"]["name"] for p in dra.request("GET", "/api/v1/namespaces/default/pods")["items"]]
    for name in pods:
        delete_pod(dra, name)
    wait_for(lambda: claims_gone(dra, pods), 60, "the claims of the pods left deleted")


def dra_gang_pod(name: str, gang: str, size: int, *, kueue: bool = False) -> dict:
    """A gang member claiming 8 GPUs through the template; ``kueue``: a member of a Kueue pod group as Kueue leaves
    it once admitted (its group label and total count; the scheduling gate already removed)."""
    if kueue:
        pod = make_pod(name, selector={"e2e": "dra"}, annotations={"kueue.x-k8s.io/pod-group-total-count": str(size)})
        pod["metadata"]["labels"] = {"kueue.x-k8s.io/pod-group-name": gang, "kueue.x-k8s.io/queue-name": "gpus"}
    else:
        pod = make_pod(name, selector={"e2e": "dra"},
                       annotations={"cachefs.io/gang": gang, "cachefs.io/gang-size": str(size)})
    pod["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus"}]
    return pod


def stop_pods(k8s, names: list[str], pause: float = 0.0) -> None:
    """Delete each pod (``pause`` seconds apart); the garbage collector deletes its claim, freeing the devices."""
    for i, name in enumerate(names):
        if i and pause:
            time.sleep(pause)
        delete_pod(k8s, name)


def claims_gone(k8s, pods: list[str]) -> bool:
    """Whether the claims made for ``pods`` (named ``<pod>-<claim>-<suffix>``) are gone."""
    items = k8s.request("GET", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims")["items"]
    return not any(c["metadata"]["name"].startswith(f"{p}-") for c in items for p in pods)


def allocated_node(k8s, pod: str) -> str | None:
    """The node whose devices kube-scheduler's DRA plugin allocated to the pod's claim (made from the template)."""
    live = k8s.request("GET", f"/api/v1/namespaces/default/pods/{pod}")
    names = [s.get("resourceClaimName") for s in (live.get("status") or {}).get("resourceClaimStatuses") or []]
    if len(names) != 1 or not names[0]:
        return None
    claim = k8s.request("GET", f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{names[0]}")
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    pools = {r["pool"] for r in results}
    return pools.pop() if len(pools) == 1 and len(results) == 8 else None


def bound(k8s, names: list[str]) -> list[str]:
    """Those of ``names`` that exist and are bound to a node."""
    out = []
    for name in names:
        try:
            if node_of(k8s, name):
                out.append(name)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
    return out


def test_a_dra_gang_lands_whole_in_the_one_clique_its_devices_say_can_hold_it(dra):
    """A Kueue pod group first, then two gangs of ours."""
    k8s = dra
    first = [f"da-{i}" for i in range(4)]
    k8s.apply(*[dra_gang_pod(p, "da", 4, kueue=True) for p in first])
    placed = [wait_for(lambda p=p: node_of(k8s, p), 90, f"{p} bound") for p in first]
    assert {DRA_NODES[n] for n in placed} == {"c2"} and len(set(placed)) == 4
    assert [allocated_node(k8s, p) for p in first] == placed  # the DRA plugin's devices are on the same nodes
    stop_pods(k8s, first)
    wait_for(lambda: claims_gone(k8s, first), 60, "the gang's claims deleted after its pods")

    # Two 32-GPU gangs arrive together on 56 GPUs: exactly one runs whole, the other waits holding nothing; it
    # runs whole in one clique once the first is gone.
    b = [f"db-{i}" for i in range(4)]
    c = [f"dc-{i}" for i in range(4)]
    wait_for(lambda: not bound(k8s, first), 30, "gang da gone")
    for i in range(4):
        k8s.apply(dra_gang_pod(b[i], "db", 4), dra_gang_pod(c[i], "dc", 4))
    wait_for(lambda: len(bound(k8s, b)) == 4 or len(bound(k8s, c)) == 4, 120, "one gang bound whole")
    time.sleep(5)  # give a would-be partial second gang time to show up
    winner, loser = (b, c) if len(bound(k8s, b)) == 4 else (c, b)
    assert len(bound(k8s, winner)) == 4 and bound(k8s, loser) == []
    assert len({DRA_NODES[node_of(k8s, n)] for n in winner}) == 1
    stop_pods(k8s, winner, pause=1.0)
    wait_for(lambda: len(bound(k8s, loser)) == 4, 120, "the waiting gang bound after its GPUs freed")
    assert len({DRA_NODES[node_of(k8s, n)] for n in loser}) == 1
    stop_pods(k8s, loser)
    wait_for(lambda: claims_gone(k8s, b + c), 60, "the claims deleted after their pods")


def test_on_a_mixed_cluster_a_gang_is_admitted_only_where_its_gpu_style_can_hold_it(dra):
    """Two nodes whose GPUs are the extended resource beside the seven DRA nodes: a gang of three 8-GPU pods of the
    extended-resource style does not fit (two such nodes) and binds nothing, though the cluster has 72 GPUs; a
    DRA gang of three binds whole."""
    k8s = dra
    for name in ("mix-e1", "mix-e2"):
        make_node(k8s, name, gpus=8, labels={"e2e": "dra"})
    time.sleep(1)
    ext_gang = []
    for i in range(3):
        pod = make_pod(f"me-{i}", gpus=8, selector={"e2e": "dra"},
                       annotations={"cachefs.io/gang": "me", "cachefs.io/gang-size": "3"})
        ext_gang.append(pod["metadata"]["name"])
        k8s.apply(pod)
    dra_gang = [f"md-{i}" for i in range(3)]
    k8s.apply(*[dra_gang_pod(p, "md", 3) for p in dra_gang])
    placed = [wait_for(lambda p=p: node_of(k8s, p), 90, f"{p} bound") for p in dra_gang]
    assert all(n in DRA_NODES for n in placed) and len(set(placed)) == 3
    # None of it binds, and not by running out the gang's bind wait with two members holding nodes: the filter
    # refuses it, since only two nodes of its style exist (counted with the DRA nodes it fit on paper).
    def refusal(name: str) -> str:
        pod = k8s.request("GET", f"/api/v1/namespaces/default/pods/{name}")
        return next((c.get("message", "") for c in (pod.get("status") or {}).get("conditions") or []
                     if c.get("type") == "PodScheduled" and c.get("status") == "False"), "")

    for name in ext_gang:
        wait_for(lambda n=name: "waiting until the whole gang fits" in refusal(n), 60, f"{name} refused whole")
    assert bound(k8s, ext_gang) == []
    stop_pods(k8s, [*dra_gang, *ext_gang])
    wait_for(lambda: claims_gone(k8s, dra_gang), 60, "the claims deleted after their pods")


def test_pods_claiming_gpus_through_dra_land_where_their_dataset_is_cached(dra):
    """Locality in the DRA form: two DRA nodes, one holding 90 % of the pods' dataset, the other 10 %. Three pods of
    one GPU each all go to the first (kube-scheduler's own spreading alone would put them on both)."""
    from .test_scheduling import URL, label_node

    k8s = dra
    for name in ("dloc-a", "dloc-b"):
        make_node(k8s, name, labels={"e2e": "dra-locality"})
        k8s.apply(gpu_slice(name, "c9"))
    label_node(k8s, "dloc-a", 900 * 2**30, 1000 * 2**30)
    label_node(k8s, "dloc-b", 100 * 2**30, 1000 * 2**30)
    time.sleep(1)  # let the extender's watches see the labels and slices
    names = [f"dloc-{i}" for i in range(3)]
    for name in names:
        pod = make_pod(name, selector={"e2e": "dra-locality"}, annotations={"cachefs.io/datasets": URL})
        pod["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "one-gpu"}]
        pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus"}]
        k8s.apply(pod)
        assert wait_for(lambda n=name: node_of(k8s, n), 60, f"{name} bound") == "dloc-a"
    stop_pods(k8s, names)
    wait_for(lambda: claims_gone(k8s, names), 60, "the claims deleted after their pods")

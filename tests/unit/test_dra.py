"""GPUs by Dynamic Resource Allocation: what the extender reads from ResourceSlices, ResourceClaims, their templates
and DeviceClasses (objects as the API server serves them, resource.k8s.io/v1)."""

from __future__ import annotations

from scheduler_hints.dra import DraInventory
from scheduler_hints.extender import Extender
from scheduler_hints.node_cache import NodeCache
from scheduler_hints.pods import pod_gang

DRIVER = "gpu.nvidia.com"


def gpu_slice(node: str, gpus: int, *, clique: str | None = None, generation: int = 1, migs: int = 0,
              pool: str | None = None, name: str | None = None) -> dict:
    devices = []
    for i in range(gpus):
        attrs = {"type": {"string": "gpu"}, "index": {"int": i}, "productName": {"string": "NVIDIA H200"},
                 "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{i // 4:02x}"}}
        if clique is not None:
            attrs["cliqueId"] = {"string": clique}
        devices.append({"name": f"gpu-{i}", "attributes": attrs, "capacity": {"memory": {"value": "141Gi"}}})
    devices += [{"name": f"mig-{i}", "attributes": {"type": {"string": "mig"}}} for i in range(migs)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name or f"{node}-{DRIVER}"},
            "spec": {"driver": DRIVER, "nodeName": node, "devices": devices,
                     "pool": {"name": pool or node, "generation": generation, "resourceSliceCount": 1}}}


def claim_spec(count: int = 1, *, cls: str = DRIVER, mode: str | None = None) -> dict:
    exactly: dict = {"deviceClassName": cls}
    if mode == "All":
        exactly["allocationMode"] = "All"
    else:
        exactly["count"] = count
    return {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}


def claim(name: str, spec: dict, *, allocated: list[tuple[str, str]] | None = None, ns: str = "default") -> dict:
    obj: dict = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": name, "namespace": ns}, "spec": spec}
    if allocated:
        obj["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpus", "driver": DRIVER, "pool": pool, "device": dev} for pool, dev in allocated]}}}
    return obj


def pod(name: str, claims: list[dict], *, statuses: list[dict] | None = None, labels: dict | None = None,
        annotations: dict | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "labels": labels or {},
                         "annotations": annotations or {}},
            "spec": {"resourceClaims": claims, "containers": [{"name": "c"}]},
            "status": {"resourceClaimStatuses": statuses or []}}


def node(name: str, labels: dict | None = None, gpus: int = 0) -> dict:
    alloc = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return {"metadata": {"name": name, "labels": labels or {}, "resourceVersion": "1"},
            "status": {"allocatable": alloc}}


def test_a_node_counts_the_gpu_devices_of_the_newest_generation_of_its_pool():
    inv = DraInventory()
    inv.on_slice("ADDED", gpu_slice("n1", 8, migs=2))
    inv.on_slice("ADDED", gpu_slice("n2", 4))
    assert (inv.node_gpus("n1"), inv.node_gpus("n2"), inv.node_gpus("n3")) == (8, 4, None)
    inv.on_slice("MODIFIED", gpu_slice("n1", 6, generation=2))  # the driver republished the pool
    inv.on_slice("MODIFIED", gpu_slice("n1", 8, generation=1))  # a stale slice of the old generation
    assert inv.node_gpus("n1") == 6
    inv.on_slice("DELETED", gpu_slice("n2", 4))
    assert inv.node_gpus("n2") is None


def test_devices_allocated_to_claims_are_held_on_their_node():
    inv = DraInventory()
    inv.on_slice("ADDED", gpu_slice("n1", 8))
    inv.on_claim("ADDED", claim("a", claim_spec(2), allocated=[("n1", "gpu-0"), ("n1", "gpu-1")]))
    inv.on_claim("ADDED", claim("b", claim_spec(1)))  # not allocated yet
    assert inv.allocated_by_node() == {"n1": 2}
    inv.on_claim("DELETED", claim("a", claim_spec(2)))
    assert inv.allocated_by_node() == {}


def test_a_pods_demand_from_templates_named_claims_shared_claims_and_all_mode():
    inv = DraInventory()
    inv.on_slice("ADDED", gpu_slice("n1", 8))
    inv.on_template("ADDED", {"metadata": {"name": "four", "namespace": "default"}, "spec": {"spec": claim_spec(4)}})
    inv.on_template("ADDED", {"metadata": {"name": "nic", "namespace": "default"},
                              "spec": {"spec": claim_spec(1, cls="rdma.example.com")}})
    from_template = pod("p", [{"name": "g", "resourceClaimTemplateName": "four"},
                              {"name": "n", "resourceClaimTemplateName": "nic"}])
    assert inv.pod_gpus(from_template, "p") == 4  # (the NIC is no GPU)
    # the generated claim exists and is allocated: its GPUs are held where they are, the pod asks for no more
    inv.on_claim("ADDED", claim("p-g-x1", claim_spec(4), allocated=[("n1", f"gpu-{i}") for i in range(4)]))
    made = pod("p", [{"name": "g", "resourceClaimTemplateName": "four"}],
               statuses=[{"name": "g", "resourceClaimName": "p-g-x1"}])
    assert inv.pod_gpus(made, "p") == 0
    # a named claim shared by two pods counts once
    inv.on_claim("ADDED", claim("shared", claim_spec(2)))
    a, b = (pod(n, [{"name": "g", "resourceClaimName": "shared"}]) for n in ("a", "b"))
    inv.on_pod("ADDED", a, "a")
    inv.on_pod("ADDED", b, "b")
    assert inv.pod_gpus(a, "a") + inv.pod_gpus(b, "b") == 2
    inv.on_slice("ADDED", gpu_slice("n2", 4))
    whole = pod("w", [{"name": "g", "resourceClaimTemplateName": "all"}])
    inv.on_template("ADDED", {"metadata": {"name": "all", "namespace": "default"},
                              "spec": {"spec": claim_spec(mode="All")}})
    assert inv.pod_gpus(whole, "w") == 8  # a whole node's GPUs


def test_a_device_class_whose_selector_names_a_gpu_driver_hands_out_gpus():
    inv = DraInventory()
    inv.on_class("ADDED", {"metadata": {"name": "h200"}, "spec": {"selectors": [{"cel": {
        "expression": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].productName == "
                      "'NVIDIA H200'"}}]}})
    inv.on_class("ADDED", {"metadata": {"name": "nic"}, "spec": {"selectors": [{"cel": {
        "expression": "device.driver == 'rdma.example.com'"}}]}})
    p = pod("p", [{"name": "g", "resourceClaimName": "c"}])
    inv.on_claim("ADDED", claim("c", {"devices": {"requests": [
        {"name": "a", "exactly": {"deviceClassName": "h200", "count": 2}},
        {"name": "b", "exactly": {"deviceClassName": "nic", "count": 4}},
        {"name": "c", "firstAvailable": [{"name": "big", "deviceClassName": "h200", "count": 3},
                                         {"name": "small", "deviceClassName": "h200", "count": 1}]}]}}))
    assert inv.pod_gpus(p, "p") == 5


def test_the_node_cache_counts_dra_gpus_and_their_clique_beside_extended_resources():
    inv = DraInventory()
    cache = NodeCache(dra=inv)
    cache.update(node("dra-1"))
    cache.update(node("dra-2", labels={"nvidia.com/gpu.clique": "from-label"}))
    cache.update(node("ext-1", gpus=8))  # a node of the device plugin: its allocatable counts
    inv.on_slice("ADDED", gpu_slice("dra-1", 8, clique="c1"))
    inv.on_slice("ADDED", gpu_slice("dra-2", 8, clique="c2"))
    cache.dra_changed()
    states = {s.name: s for s in cache.cluster()[0]}
    assert {n: s.gpu_allocatable for n, s in states.items()} == {"dra-1": 8, "dra-2": 8, "ext-1": 8}
    assert states["dra-1"].labels["nvidia.com/gpu.clique"] == "c1"
    assert states["dra-2"].labels["nvidia.com/gpu.clique"] == "from-label"  # the Node's own label wins
    inv.on_slice("MODIFIED", gpu_slice("dra-1", 4, clique="c1", generation=2))
    cache.dra_changed()
    assert cache.base_state(cache.nodes["dra-1"]).gpu_allocatable == 4


def test_the_extender_adds_claimed_gpus_to_a_pods_demand_and_holds_allocated_ones():
    inv = DraInventory()
    ext = Extender(dra=inv)
    inv.on_slice("ADDED", gpu_slice("n1", 8))
    inv.on_template("ADDED", {"metadata": {"name": "two", "namespace": "default"}, "spec": {"spec": claim_spec(2)}})
    p = pod("p", [{"name": "g", "resourceClaimTemplateName": "two"}])
    p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}  # both styles on one pod
    assert ext.gpus_of(p) == 3
    inv.on_claim("ADDED", claim("x", claim_spec(2), allocated=[("n1", "gpu-0"), ("n1", "gpu-5")]))
    assert ext.held()["n1"] == 2


def test_gangs_of_kai_kueue_pod_groups_and_kueue_workloads():
    kai = pod_gang(pod("a", [], annotations={"pod-group-name": "train"}), {"default/train": 4})
    assert (kai.name, kai.min_member, kai.topology_assigned) == ("train", 4, False)
    group = pod_gang(pod("b", [], labels={"kueue.x-k8s.io/pod-group-name": "g"},
                         annotations={"kueue.x-k8s.io/pod-group-total-count": "3"}))
    assert (group.name, group.min_member) == ("g", 3)
    wl = pod_gang(pod("c", [], labels={"kueue.x-k8s.io/tas": "true", "kueue.x-k8s.io/podset": "main"},
                      annotations={"kueue.x-k8s.io/workload": "job-train-3f2a1"}), {"default/job-train-3f2a1": 16})
    assert (wl.name, wl.min_member, wl.topology_assigned) == ("job-train-3f2a1", 16, True)


def _gang_pod(name: str, gang: str, size: int, *, dra: bool) -> dict:
    p = pod(name, [{"name": "g", "resourceClaimTemplateName": "eight"}] if dra else [],
            annotations={"cachefs.io/gang": gang, "cachefs.io/gang-size": str(size)})
    if not dra:
        p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "8"}}
    return p


def _mixed_cluster() -> Extender:
    """Two nodes whose 8 GPUs are extended resources, two whose 8 GPUs a DRA driver publishes."""
    inv = DraInventory()
    ext = Extender(dra=inv)
    for name in ("ext-1", "ext-2"):
        ext.node_cache.update(node(name, gpus=8))
    for name in ("dra-1", "dra-2"):
        ext.node_cache.update(node(name))
        inv.on_slice("ADDED", gpu_slice(name, 8))
    ext.node_cache.dra_changed()
    inv.on_template("ADDED", {"metadata": {"name": "eight", "namespace": "default"}, "spec": {"spec": claim_spec(8)}})
    return ext


def _refused(ext: Extender, p: dict) -> bool:
    return bool(ext.filter({"Pod": p, "NodeNames": ["ext-1", "ext-2", "dra-1", "dra-2"]})["FailedNodes"])


def test_on_a_mixed_cluster_a_gang_counts_only_the_nodes_of_its_gpu_style():
    # 32 GPUs in all, but only 16 of each style: a 3-pod gang of either style cannot run whole, a 2-pod one can
    for dra in (False, True):
        ext = _mixed_cluster()
        assert _refused(ext, _gang_pod("a", "g3", 3, dra=dra))
        assert not _refused(ext, _gang_pod("b", "g2", 2, dra=dra))


def test_a_class_mapping_the_extended_resource_lets_its_pods_use_dra_nodes_counted_once():
    ext = _mixed_cluster()
    assert ext.dra is not None
    ext.dra.on_class("ADDED", {"metadata": {"name": "gpu-as-extended"},
                               "spec": {"extendedResourceName": "nvidia.com/gpu", "selectors": []}})
    assert not _refused(ext, _gang_pod("a", "g3", 3, dra=False))  # two extended-resource nodes and the DRA ones
    # such a pod bound on a DRA node holds its GPUs through the claim kube-scheduler made, not twice
    ext.bound_pods["uid-x"] = ("dra-1", 8)
    ext.dra.on_claim("ADDED", claim("x-extended", claim_spec(8), allocated=[("dra-1", f"gpu-{i}") for i in range(8)]))
    assert ext.held()["dra-1"] == 8


def test_a_gang_counts_only_the_nodes_its_node_selector_matches():
    """Kueue writes the flavor's and the topology assignment's labels into the pods' node selectors: a gang whose
    selector leaves two 8-GPU nodes does not fit three 8-GPU pods, however many GPUs the rest of the cluster has."""
    ext = Extender()
    for i in range(4):
        ext.node_cache.update(node(f"n{i}", labels={"nvidia.com/gpu.clique": "a" if i < 2 else "b"}, gpus=8))
    names = [f"n{i}" for i in range(4)]

    def gang(name: str, gang: str, selector: dict | None) -> dict:
        p = _gang_pod(name, gang, 3, dra=False)
        if selector:
            p["spec"]["nodeSelector"] = selector
        return p

    assert ext.filter({"Pod": gang("s", "in-a", {"nvidia.com/gpu.clique": "a"}), "NodeNames": names})["FailedNodes"]
    assert not ext.filter({"Pod": gang("u", "anywhere", None), "NodeNames": names})["FailedNodes"]


def test_the_reflectors_sync_marker_is_not_an_object():
    inv = DraInventory()
    for on in (inv.on_slice, inv.on_claim, inv.on_template, inv.on_class):
        on("SYNC", {})
    assert not inv._claims and not inv._templates and inv.node_gpus("") is None


def test_an_object_of_the_wrong_shape_is_ignored_whole_and_numbers_as_strings_are_read():
    inv = DraInventory()
    good = gpu_slice("n1", 4)
    good["spec"]["pool"]["generation"] = "2"  # (a number sent as a string)
    inv.on_slice("ADDED", good)
    assert inv.node_gpus("n1") == 4
    bad = gpu_slice("n2", 8)
    bad["spec"]["devices"] = {"gpu-0": {}}  # a map where the API has a list
    inv.on_slice("ADDED", bad)
    inv.on_slice("ADDED", {"spec": "not an object"})
    assert inv.node_gpus("n2") is None and inv.node_gpus("n1") == 4
    inv.on_claim("ADDED", {"metadata": {"name": "c"}, "status": {"allocation": {"devices": {"results": 7}}}})
    inv.on_class("ADDED", {"metadata": {"name": DRIVER}, "spec": {"selectors": "device.driver == 'x'"}})
    inv.on_template("ADDED", {"metadata": ["t"]})
    assert not inv._claims and not inv._templates and inv.allocated_by_node() == {}


def test_a_bound_gang_holds_its_gpus_until_the_claim_watch_shows_them_allocated():
    """kube-scheduler writes a member's allocation (PreBind) before it asks the extender to bind; the claim watch may
    tell the extender later. In between, a bound gang's GPUs must not look free: another gang admitted then went
    across cliques once GPUs freed (a full e2e run)."""
    import asyncio

    ext = _mixed_cluster()
    assert ext.dra is not None
    names = ["ext-1", "ext-2", "dra-1", "dra-2"]
    members = []
    for i in range(2):
        p = _gang_pod(f"a{i}", "first", 2, dra=True)
        p["status"]["resourceClaimStatuses"] = [{"name": "g", "resourceClaimName": f"a{i}-g"}]
        ext.dra.on_claim("ADDED", claim(f"a{i}-g", claim_spec(8)))
        assert not ext.filter({"Pod": p, "NodeNames": names})["FailedNodes"]
        members.append(p)

    async def bind_all() -> None:
        await asyncio.gather(*(ext.bind({"PodName": p["metadata"]["name"], "PodNamespace": "default",
                                         "PodUID": p["metadata"]["uid"], "Node": f"dra-{i + 1}"})
                               for i, p in enumerate(members)))

    asyncio.run(bind_all())
    assert ext.held() == {"dra-1": 8, "dra-2": 8}  # bound; the watch has not shown the allocations yet
    assert _refused(ext, _gang_pod("b0", "second", 2, dra=True))
    for i in range(2):  # the watch catches up: held by the claims, counted once
        ext.dra.on_claim("MODIFIED", claim(f"a{i}-g", claim_spec(8),
                                           allocated=[(f"dra-{i + 1}", f"gpu-{j}") for j in range(8)]))
    assert ext.held() == {"dra-1": 8, "dra-2": 8}
    for i in range(2):  # the pods end: their claims go, and the GPUs are free again
        ext.pod_gone(members[i]["metadata"]["uid"])
        ext.dra.on_claim("DELETED", claim(f"a{i}-g", claim_spec(8)))
    assert ext.held() == {}
    assert not _refused(ext, _gang_pod("b0", "second", 2, dra=True))

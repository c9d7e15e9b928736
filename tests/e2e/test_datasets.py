"""CacheDatasets on the real API server: the CRD from deploy/ (schema, status subresource, printer columns), and
`cachefs dataset-controller` writing each dataset's status from the node annotations the agents publish (here
written by hand, as an agent would: tests/node reads a dataset through a pod and sees its status)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error

import pytest

from cachefs.base.types import dataset_id

from .controlplane import REPO
from .test_scheduling import make_node, wait_for

pytestmark = pytest.mark.slow

URL = "s3://e2e-bucket/datasets/imagenet"
API = "/apis/cachefs.io/v1alpha1/namespaces/default/cachedatasets"


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/cachedatasets.cachefs.io"


@pytest.fixture(scope="module")
def crd(k8s):
    """deploy/'s CRD, made for this module and removed after it (test_deploy.py applies every manifest too)."""
    wait_for(lambda: _crd(k8s) is None, 60, "an earlier CachedDataset CRD gone")
    k8s.apply_file(REPO / "deploy" / "base" / "cachedataset-crd.yaml")
    wait_for(lambda: _established(k8s), 60, "the CRD established")
    yield k8s
    k8s.request("DELETE", CRD_PATH)
    wait_for(lambda: _crd(k8s) is None, 60, "the CRD gone")


def _crd(k8s) -> dict | None:
    try:
        return k8s.request("GET", CRD_PATH)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            return None
        raise


def _established(k8s) -> bool:
    crd = _crd(k8s) or {}
    return any(c["type"] == "Established" and c["status"] == "True" for c in crd.get("status", {}).get("conditions", []))


def annotate(k8s, node: str, cached: int, total: int, guest: int = 0) -> None:
    ann = {f"ds.cachefs.io/{dataset_id(URL)}": json.dumps(
        {"url": URL, "cachedBytes": cached, "totalBytes": total, "guestBytes": guest, "totalFiles": 1281,
         "manifestVersion": 1})}
    k8s.request("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"annotations": ann}},
                content_type="application/merge-patch+json")


def controller_once(k8s) -> dict:
    out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "dataset-controller", "--once", "--kubeconfig",
                          str(k8s.admin_kubeconfig)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_dataset_shows_what_the_nodes_of_its_group_hold_in_its_status_and_in_kubectl_columns(crd):
    k8s = crd
    for name in ("ds-a", "ds-b", "ds-c"):
        make_node(k8s, name, labels={"cachefs.io/cache-group": "rack-1" if name != "ds-c" else "rack-2"})
    k8s.apply({"apiVersion": "cachefs.io/v1alpha1", "kind": "CacheDataset",
               "metadata": {"name": "imagenet", "namespace": "default"},
               "spec": {"url": URL, "cacheGroup": "rack-1", "warmup": {"enabled": True}}})
    assert controller_once(k8s)["written"] == 1
    st = k8s.request("GET", f"{API}/imagenet")["status"]
    assert st["phase"] == "Pending" and st["cachedBytes"] == 0
    annotate(k8s, "ds-a", 400 * 2**20, 1000 * 2**20)
    annotate(k8s, "ds-b", 350 * 2**20, 1000 * 2**20, guest=50 * 2**20)
    annotate(k8s, "ds-c", 900 * 2**20, 1000 * 2**20)  # another group: not where this dataset is placed
    controller_once(k8s)
    st = k8s.request("GET", f"{API}/imagenet")["status"]
    assert st["phase"] == "Warming" and st["cachedBytes"] == 700 * 2**20 and st["cachedPercentage"] == "70.0%"
    assert st["files"] == 1281 and st["size"] == "1000.0 MiB"
    assert {n["name"]: n["cachedBytes"] for n in st["nodes"]} == {"ds-a": 400 * 2**20, "ds-b": 350 * 2**20,
                                                                  "ds-c": 900 * 2**20}
    assert controller_once(k8s)["written"] == 0  # nothing changed: nothing written
    # kubectl get cachedatasets: the printer columns, as the API server renders them for kubectl
    table = json.loads(k8s.request("GET", API, raw=True, accept="application/json;as=Table;v=v1;g=meta.k8s.io"))
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns[:5] == ["Name", "URL", "Size", "Cached", "Phase"]
    assert table["rows"][0]["cells"][:5] == ["imagenet", URL, "1000.0 MiB", "70.0%", "Warming"]
    annotate(k8s, "ds-b", 0, 1000 * 2**20)  # evicted there: the status follows, never claiming what is gone
    controller_once(k8s)
    assert k8s.request("GET", f"{API}/imagenet")["status"]["cachedBytes"] == 400 * 2**20
    k8s.request("DELETE", f"{API}/imagenet")
    for name in ("ds-a", "ds-b", "ds-c"):
        k8s.request("DELETE", f"/api/v1/nodes/{name}")


def test_the_schema_refuses_a_dataset_without_a_url(crd):
    with pytest.raises(urllib.error.HTTPError) as refused:
        crd.apply({"apiVersion": "cachefs.io/v1alpha1", "kind": "CacheDataset",
                   "metadata": {"name": "no-url", "namespace": "default"}, "spec": {"cacheGroup": "rack-1"}})
    assert refused.value.code == 422 and b"url" in refused.value.read()
    refused.value.close()


def test_two_controllers_with_one_lease_write_from_one_of_them(crd):
    """Two replicas of the CSI controller Deployment each run one; the Lease picks the writer."""
    import asyncio

    from cachefs.kube import KubeClient, load_kube_config
    from scheduler_hints.datasets import DatasetController

    async def both() -> list[bool]:
        kube = KubeClient(load_kube_config(str(crd.admin_kubeconfig)))
        try:
            a = DatasetController(kube, lease="default/e2e-datasets", identity="replica-a")
            b = DatasetController(kube, lease="default/e2e-datasets", identity="replica-b")
            return [await a.leading(), await b.leading(), await a.leading(), await b.leading()]
        finally:
            await kube.aclose()

    assert asyncio.run(both()) == [True, False, True, False]
    lease = crd.request("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/e2e-datasets")
    assert lease["spec"]["holderIdentity"] == "replica-a"


async def first_look(warmups) -> None:
    """The agent's first look at the CacheDatasets (a CRD made just now answers 429 while its storage starts)."""
    import asyncio

    from cachefs.kube import ApiError

    for _ in range(100):
        try:
            await warmups.once()
            return
        except ApiError as exc:
            if exc.status != 429:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("the CacheDatasets never answered")


def _node_kubeconfig(k8s, path) -> str:
    """A kubeconfig with a token of the node pods' service account (cachefs-node), as the CSI plugin runs."""
    from .controlplane import _kubeconfig

    token = k8s.request("POST", "/api/v1/namespaces/cachefs-system/serviceaccounts/cachefs-node/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600}})["status"]["token"]
    return str(_kubeconfig(path, k8s.server, token))


@pytest.mark.root
def test_a_volume_naming_a_cachedataset_mounts_it_with_its_secret_in_the_pods_namespace_only(crd, tmp_path):
    """An inline volume says `dataset: imagenet`: the node plugin reads the CacheDataset in the pod's namespace and
    mounts its URL with its credentials Secret, which the node's service account reads only once a Role grants it
    (deploy/'s RBAC on a real API server). Another namespace's pod, a namespaced name, a dataset without its Secret:
    refused, nothing mounted."""
    import base64
    import hashlib

    import grpc

    from csi.datasets import POD_NAMESPACE, DatasetLookupError, DatasetResolver
    from csi.gen import csi_pb2 as pb
    from csi.volume import DatasetVolume

    from .test_csi import Plugin, kubelet_target, tree_hashes, unmount_under

    src = tmp_path / "src"
    files = {f"d{i % 2}/f{i}.bin": bytes([i]) * (1000 + i) for i in range(6)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    ns = "ml-volumes"
    crd.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    crd.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "imagenet-credentials", "namespace": ns},
               "data": {"awsAccessKeyID": base64.b64encode(b"AKIDNODE").decode(),
                        "awsSecretAccessKey": base64.b64encode(b"never-logged").decode()}})
    crd.apply({"apiVersion": "cachefs.io/v1alpha1", "kind": "CacheDataset", "metadata": {"name": "imagenet",
               "namespace": ns}, "spec": {"url": f"file://{src}", "credentialsSecret": "imagenet-credentials"}})
    crd.apply({"apiVersion": "cachefs.io/v1alpha1", "kind": "CacheDataset", "metadata": {"name": "no-secret",
               "namespace": ns}, "spec": {"url": f"file://{src}", "credentialsSecret": "nothing-by-that-name"}})
    kubeconfig = _node_kubeconfig(crd, tmp_path / "node.kubeconfig")
    resolver = DatasetResolver(kubeconfig)
    by_name = DatasetVolume.from_attributes({"dataset": "imagenet"})

    # The node's service account reads the object but not the Secret until a Role grants it.
    with pytest.raises(DatasetLookupError) as refused:
        resolver.resolve(by_name, {POD_NAMESPACE: ns}, {})
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED and "imagenet-credentials" in str(refused.value)
    crd.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "cachefs-warm-credentials", "namespace": ns},
               "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["imagenet-credentials"],
                          "verbs": ["get"]}]})
    crd.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "cachefs-warm-credentials", "namespace": ns},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cachefs-warm-credentials"},
               "subjects": [{"kind": "ServiceAccount", "name": "cachefs-node", "namespace": "cachefs-system"}]})

    def granted() -> bool:
        try:
            resolver.resolve(by_name, {POD_NAMESPACE: ns}, {})
            return True
        except DatasetLookupError:
            return False

    wait_for(granted, 30, "the Role granted")
    vol, env = resolver.resolve(by_name, {POD_NAMESPACE: ns}, {})
    assert vol.url == f"file://{src}" and not vol.dataset
    assert env == {"AWS_ACCESS_KEY_ID": "AKIDNODE", "AWS_SECRET_ACCESS_KEY": "never-logged"}
    _, given = resolver.resolve(by_name, {POD_NAMESPACE: ns}, {"awsAccessKeyID": "K", "awsSecretAccessKey": "S"})
    assert given == {"AWS_ACCESS_KEY_ID": "K", "AWS_SECRET_ACCESS_KEY": "S"}  # kubelet's nodePublishSecretRef wins

    plugin = Plugin(tmp_path / "plugin", extra=("--kubeconfig", kubeconfig))
    cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))

    def publish(target, context: dict) -> None:
        plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=f"csi-{hashlib.sha256(str(target).encode()).hexdigest()}", target_path=str(target),
            readonly=True, volume_capability=cap, volume_context={
                "csi.storage.k8s.io/ephemeral": "true", "csi.storage.k8s.io/pod.name": "reader", **context}))

    try:
        target = kubelet_target(tmp_path, "uid-1")
        publish(target, {"dataset": "imagenet", POD_NAMESPACE: ns})
        assert tree_hashes(target) == {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}
        for i, (context, code) in enumerate([
                ({"dataset": "imagenet", POD_NAMESPACE: "default"}, grpc.StatusCode.NOT_FOUND),  # not its namespace
                ({"dataset": f"{ns}/imagenet", POD_NAMESPACE: "default"}, grpc.StatusCode.INVALID_ARGUMENT),
                ({"dataset": "imagenet"}, grpc.StatusCode.FAILED_PRECONDITION),  # no pod namespace from kubelet
                ({"dataset": "no-secret", POD_NAMESPACE: ns}, grpc.StatusCode.PERMISSION_DENIED),  # (not granted)
                ({"dataset": "nothing-by-that-name", POD_NAMESPACE: ns}, grpc.StatusCode.NOT_FOUND),
                ({"dataset": "imagenet", "url": f"file://{src}", POD_NAMESPACE: ns}, grpc.StatusCode.INVALID_ARGUMENT)]):
            other = kubelet_target(tmp_path, f"uid-refused-{i}")
            with pytest.raises(grpc.RpcError) as err:
                publish(other, context)
            assert err.value.code() == code, (context, err.value.details())
            assert not os.path.exists(other), context
    finally:
        log = plugin.stop()
        unmount_under(tmp_path)
    assert "never-logged" not in log and "Traceback" not in log


def test_a_warm_up_says_its_progress_on_its_node_and_in_its_metrics(crd, tmp_path):
    """The agent's warm-up task (in this process, on the real API server): a CacheDataset with `warmup.enabled`
    placed on the node is warmed whole; the node's annotation and the cachefs_warmup_* metrics say the same N of N
    files and bytes, and the metrics say it is no longer running."""
    import asyncio

    from prometheus_client import REGISTRY

    from cachefs.agent.node_agent import AgentContext
    from cachefs.base.config import load_config
    from cachefs.cluster.cachedatasets import warm_key
    from cachefs.engine import Engine
    from cachefs.jobs.warmups import Warmups
    from cachefs.kube import KubeClient, load_kube_config

    src = tmp_path / "src"
    files = {f"d{i % 3}/f{i:03d}.bin": bytes([i]) * (300 + 97 * i) for i in range(40)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    url = f"file://{src}"
    make_node(crd, "warm-metrics", labels={"e2e": "warm-metrics"})
    crd.apply({"apiVersion": "cachefs.io/v1alpha1", "kind": "CacheDataset",
               "metadata": {"name": "warm-metrics", "namespace": "default"},
               "spec": {"url": url, "nodeSelector": {"e2e": "warm-metrics"}, "warmup": {"enabled": True}}})
    config = load_config(env={}, overrides={"cache_dir": str(tmp_path / "cache"), "cache_min_free": "0"})

    def metric(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"dataset": url, **labels})

    async def scenario() -> dict:
        engine = Engine(config)
        kube = KubeClient(load_kube_config(str(crd.admin_kubeconfig)))
        try:
            warmups = Warmups(AgentContext(config, "warm-metrics", "", engine, None, kube))
            await warmups.once()
            ((_, task),) = warmups._running.values()
            await asyncio.wait_for(task, 120)
            node = await kube.get("/api/v1/nodes/warm-metrics")
            return json.loads(node["metadata"]["annotations"][warm_key(dataset_id(url))])
        finally:
            await kube.aclose()
            await engine.aclose()

    said = asyncio.run(scenario())
    total = sum(len(d) for d in files.values())
    assert said["state"] == "done" and (said["filesDone"], said["filesTotal"]) == (40, 40), said
    assert (said["bytesDone"], said["bytesTotal"]) == (total, total), said
    assert metric("cachefs_warmup_files", state="done") == metric("cachefs_warmup_files", state="wanted") == 40
    assert metric("cachefs_warmup_bytes", state="done") == metric("cachefs_warmup_bytes", state="wanted") == total
    assert metric("cachefs_warmup_files", state="failed") == 0 and metric("cachefs_warmup_running") == 0
    crd.request("DELETE", "/apis/cachefs.io/v1alpha1/namespaces/default/cachedatasets/warm-metrics")


def test_a_scheduled_warm_up_lists_the_source_again_and_any_refresh_warms_what_is_new(crd, tmp_path):
    """`warmup.schedule` (cron, UTC): at its next time the agent lists the source again and warms the new files (the
    clock is the task's, moved by hand: no waiting for a minute); between times nothing runs. A refresh taken by
    someone else (`cachefs refresh`, or the group's listing) is warmed at the next look. A schedule that is not cron
    is said in the node's annotation, and the warm-up itself still runs."""
    import asyncio

    from cachefs.agent.node_agent import AgentContext
    from cachefs.base.config import load_config
    from cachefs.cluster.cachedatasets import warm_key
    from cachefs.engine import Engine
    from cachefs.jobs.warmups import Warmups
    from cachefs.kube import KubeClient, load_kube_config

    src = tmp_path / "src"

    def add(first: int, count: int) -> None:
        for i in range(first, first + count):
            (src / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
            (src / f"d{i % 2}" / f"f{i:03d}.bin").write_bytes(bytes([i]) * (200 + i))

    add(0, 10)
    url = f"file://{src}"
    make_node(crd, "warm-cron", labels={"e2e": "warm-cron"})
    path = "/apis/cachefs.io/v1alpha1/namespaces/default/cachedatasets"
    crd.apply({"apiVersion": "cachefs.io/v1alpha1", "kind": "CacheDataset",
               "metadata": {"name": "warm-cron", "namespace": "default"},
               "spec": {"url": url, "nodeSelector": {"e2e": "warm-cron"},
                        "warmup": {"enabled": True, "schedule": "0 */6 * * *"}}})
    config = load_config(env={}, overrides={"cache_dir": str(tmp_path / "cache"), "cache_min_free": "0"})
    clock = [1_800_000_000.0]  # (2027-01-15 08:00 UTC; the next 6-hourly time is 12:00)

    async def scenario() -> None:
        engine = Engine(config)
        kube = KubeClient(load_kube_config(str(crd.admin_kubeconfig)))
        warmups = Warmups(AgentContext(config, "warm-cron", "", engine, None, kube))
        warmups.clock = lambda: clock[0]

        async def look() -> tuple[object, dict]:
            await warmups.once()
            ((_, task),) = warmups._running.values()
            await asyncio.wait_for(task, 120)
            node = await kube.get("/api/v1/nodes/warm-cron")
            return task, json.loads(node["metadata"]["annotations"][warm_key(dataset_id(url))])

        try:
            first, said = await look()
            assert (said["state"], said["filesDone"], said["filesTotal"]) == ("done", 10, 10), said
            add(10, 5)
            clock[0] += 3 * 3600  # 11:00: not yet
            task, said = await look()
            assert task is first and said["filesTotal"] == 10
            clock[0] += 3600 + 1  # past 12:00: listed again, the new files warmed
            task, said = await look()
            assert task is not first and (said["filesDone"], said["filesTotal"]) == (15, 15), said
            assert engine.index.dataset(dataset_id(url)).current == 2
            add(15, 2)
            await engine.refresh(url)  # someone else's refresh (cachefs refresh, the group's member)
            refreshed, said = await look()
            assert refreshed is not task and (said["filesDone"], said["filesTotal"]) == (17, 17), said
            assert engine.index.dataset(dataset_id(url)).current == 3  # (warmed, not listed a fourth time)
            again, _ = await look()
            assert again is refreshed  # nothing new, not due: nothing runs
            crd.request("PATCH", f"{path}/warm-cron", {"spec": {"warmup": {"schedule": "every day"}}},
                        content_type="application/merge-patch+json")
            _, said = await look()  # (a changed object: a new warm-up, which says what is wrong with the schedule)
            assert said["state"] == "done" and "not a cron expression" in said["reason"], said
        finally:
            await kube.aclose()
            await engine.aclose()

    asyncio.run(scenario())
    crd.request("DELETE", f"{path}/warm-cron")


@pytest.mark.root
def test_a_pod_whose_session_the_new_node_pod_cannot_take_over_gets_an_event_saying_why(crd, tmp_path):
    """Version skew (docs/UPGRADES.md): the new generation's mounter notes the sessions it leaves with the previous
    one (cachefs.index.mounts.record_left_behind, as tests/unit/test_generations.py shows it doing); the node plugin,
    as the node pods' service account (deploy/'s RBAC), posts one Warning event on each pod using such a session,
    saying why, and only once."""
    import hashlib

    from cachefs.index.mounts import record_left_behind
    from csi.events import REASON
    from csi.gen import csi_pb2 as pb

    from .test_csi import Plugin, kubelet_target, unmount_under
    from .test_scheduling import make_pod

    plugin = Plugin(tmp_path / "plugin", extra=("--kubeconfig", _node_kubeconfig(crd, tmp_path / "node.kubeconfig")))
    sessions = tmp_path / "plugin" / "cache" / "csi" / "sessions"

    def reader(name: str) -> tuple[str, str]:
        """A pod reading a dataset of its own (its own session): (its uid, the session's mountpoint)."""
        src = tmp_path / f"src-{name}"
        src.mkdir()
        (src / "a.bin").write_bytes(name.encode() * 100)
        crd.apply(make_pod(name, node="warm-skew"))
        uid = crd.request("GET", f"/api/v1/namespaces/default/pods/{name}")["metadata"]["uid"]
        target = kubelet_target(tmp_path, uid)
        before = set(sessions.iterdir()) if sessions.exists() else set()
        plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=f"csi-{hashlib.sha256(str(target).encode()).hexdigest()}", target_path=str(target),
            readonly=True, volume_capability=pb.VolumeCapability(
                mount=pb.VolumeCapability.MountVolume(),
                access_mode=pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)),
            volume_context={"url": f"file://{src}", "csi.storage.k8s.io/ephemeral": "true",
                            "csi.storage.k8s.io/pod.name": name, "csi.storage.k8s.io/pod.namespace": "default",
                            "csi.storage.k8s.io/pod.uid": uid}))
        (new,) = set(sessions.iterdir()) - before
        return uid, str(new / "mnt")

    def events(name: str) -> list[dict]:
        got = crd.request("GET", f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{name}")
        return [e for e in got["items"] if e.get("reason") == REASON]

    why = "its node pod generation (release 9.9) hands sessions over in version 9, this one knows up to 2"
    cache = str(tmp_path / "plugin" / "cache")
    try:
        uid, mnt = reader("skewed-1")
        record_left_behind(cache, {mnt: why})
        (said,) = wait_for(lambda: events("skewed-1"), 60, "the pod's event")
        assert said["type"] == "Warning" and why in said["message"], said
        assert said["involvedObject"]["uid"] == uid and said["source"]["component"] == "cachefs-csi"
        _, mnt2 = reader("skewed-2")  # a second session left: its event comes from a later look of the plugin ...
        record_left_behind(cache, {mnt: why, mnt2: why})
        wait_for(lambda: events("skewed-2"), 60, "the second pod's event")
        assert len(events("skewed-1")) == 1  # ... which did not say the first again
    finally:
        log = plugin.stop()
        unmount_under(tmp_path)
        for name in ("skewed-1", "skewed-2"):
            crd.request("DELETE", f"/api/v1/namespaces/default/pods/{name}")
    assert "Traceback" not in log


def test_the_group_a_pending_gang_will_land_in_warms_its_dataset_until_the_gang_is_admitted(crd, tmp_path):
    """The extender's write of its warm targets (as the scheduler's service account: deploy/'s Role for the one
    ConfigMap) and a node agent of that cache group warming from it (as the node pods' service account): the
    dataset is warmed on the node, and once the target is dropped the next writes remove it."""
    import asyncio

    from cachefs.agent.node_agent import AgentContext
    from cachefs.base.config import load_config
    from cachefs.cluster.cachedatasets import WARM_FOR, warm_key
    from cachefs.engine import Engine
    from cachefs.jobs.warmups import Warmups
    from cachefs.kube import KubeClient, load_kube_config
    from scheduler_hints.extender import Extender
    from scheduler_hints.prewarm import WarmTarget
    from scheduler_hints.watch import ClusterWatch

    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i:02d}.bin").write_bytes(bytes([i]) * (400 + i))
    url = f"file://{src}"
    make_node(crd, "prewarm-b1", labels={"cachefs.io/cache-group": "rack-prewarm"})
    config = load_config(env={}, overrides={"cache_dir": str(tmp_path / "cache"), "cache_min_free": "0"})

    async def scenario() -> None:
        ext = Extender()
        watch = ClusterWatch(KubeClient(load_kube_config(str(crd.extender_kubeconfig))), ext)
        node_kube = KubeClient(load_kube_config(_node_kubeconfig(crd, tmp_path / "node.kubeconfig")))
        # (the agent itself as admin: the node pods' token may patch only its own Node, which needs a pod-bound
        # token; what the node's service account may read is checked below with its own token)
        agent_kube = KubeClient(load_kube_config(str(crd.admin_kubeconfig)))
        engine = Engine(config)
        warmups = Warmups(AgentContext(config, "prewarm-b1", "rack-prewarm", engine, None, agent_kube))
        try:
            ext.prewarm.targets["ml/pending"] = WarmTarget("rack-prewarm", (url,), ext.prewarm.clock())
            assert await watch.write_prewarm()  # (created: the first target)
            assert not await watch.write_prewarm()  # (unchanged: not written again)
            assert json.loads((await node_kube.get(WARM_FOR))["data"]["rack-prewarm"]) == [url]  # (readable by nodes)
            await first_look(warmups)
            ((_, task),) = warmups._running.values()
            await asyncio.wait_for(task, 120)
            node = await agent_kube.get("/api/v1/nodes/prewarm-b1")
            said = json.loads(node["metadata"]["annotations"][warm_key(dataset_id(url))])
            assert (said["state"], said["filesDone"], said["filesTotal"]) == ("done", 12, 12), said
            ext.prewarm.drop("ml/pending")  # admitted
            assert await watch.write_prewarm()
            assert (await node_kube.get(WARM_FOR)).get("data") in (None, {})
            await warmups.once()
            assert not warmups._running  # (nothing asks for it now)
        finally:
            for client in (watch.client, node_kube, agent_kube):
                await client.aclose()
            await engine.aclose()

    asyncio.run(scenario())


def test_a_warm_up_whose_dataset_is_still_listed_shows_listing_with_the_files_found(crd, tmp_path, monkeypatch):
    """A warm-up of a dataset no node has listed yet: while its first listing runs (one directory's LIST held by the
    synthetic endpoint, so it cannot finish), the node's annotation says listing with the files found so far, and
    the status the controller makes of it is Listing, not a Pending dataset of no size."""
    import asyncio
    import urllib.request

    from cachefs.agent.node_agent import AgentContext
    from cachefs.base.config import load_config
    from cachefs.cluster.cachedatasets import warm_key
    from cachefs.engine import Engine
    from cachefs.jobs.warmups import Warmups
    from cachefs.kube import KubeClient, load_kube_config
    from cachefs.testing.synthetic_s3 import running
    from scheduler_hints.datasets import dataset_status

    for k, v in {"AWS_ACCESS_KEY_ID": "synthetic", "AWS_SECRET_ACCESS_KEY": "synthetic", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    url = "s3://synthetic"
    make_node(crd, "listing-a", labels={"e2e": "listing"})
    config = load_config(env={}, overrides={"cache_dir": str(tmp_path / "cache"), "cache_min_free": "0"})
    path = "/apis/cachefs.io/v1alpha1/namespaces/default/cachedatasets"
    with running("--objects", "20000", "--hold-prefix", "d000019/") as endpoint:
        crd.apply({"apiVersion": "cachefs.io/v1alpha1", "kind": "CacheDataset",
                   "metadata": {"name": "listing", "namespace": "default"},
                   "spec": {"url": url, "endpointUrl": endpoint, "region": "us-east-1",
                            "nodeSelector": {"e2e": "listing"}, "warmup": {"enabled": True}}})

        async def scenario() -> tuple[dict, dict]:
            engine = Engine(config)
            kube = KubeClient(load_kube_config(str(crd.admin_kubeconfig)))
            warmups = Warmups(AgentContext(config, "listing-a", "", engine, None, kube))
            try:
                await first_look(warmups)
                for _ in range(300):
                    node = await kube.get("/api/v1/nodes/listing-a")
                    raw = (node["metadata"].get("annotations") or {}).get(warm_key(dataset_id(url)))
                    said = json.loads(raw) if raw else {}
                    if said.get("state") == "listing" and said.get("filesListed", 0) > 0:
                        obj = await kube.get(f"{path}/listing")
                        return said, dataset_status(obj, [node], now=1.0)
                    await asyncio.sleep(0.2)
                raise AssertionError("the node never said it was listing")
            finally:
                with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/_synthetic/release", method="POST"),
                                            timeout=30):
                    pass
                for _, task in warmups._running.values():
                    task.cancel()
                await asyncio.gather(*(t for _, t in warmups._running.values()), return_exceptions=True)
                await kube.aclose()
                await engine.aclose()

        said, status = asyncio.run(scenario())
    assert 0 < said["filesListed"] < 20_000, said
    assert status["phase"] == "Listing" and status["listedFiles"] == said["filesListed"], status
    crd.request("DELETE", f"{path}/listing")

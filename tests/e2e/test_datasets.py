"""CacheDatasets on the real API server: the CRD from deploy/ (schema, status subresource, printer columns), and
`cachefs dataset-controller` writing each dataset's status from the node annotations the agents publish (here
written by hand, as an agent would: tests/node reads a dataset through a pod and sees its status)."""

from __future__ import annotations

import json
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

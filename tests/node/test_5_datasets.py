"""A CacheDataset on the real node: the agent warms it (with the credentials Secret a Role lets it read), the
dataset controller in the CSI controller Deployment writes its status from the agent's own accounting, `kubectl get
cachedatasets` shows it, a pod then reads it without asking the origin, and the status never claims bytes that are
no longer on the node's disk (evicted: it follows). The reading pod's volume names the dataset rather than its URL."""

from __future__ import annotations

import json
import subprocess
import sys

from .cluster import CACHE_DIR
from .conftest import REPORT
from .test_3_faults import cold_dataset, origin_gets_under, reader_result, start_reader


def node_pins(url: str) -> list[str] | None:
    """Who pins ``url`` in the node's cache (``cachefs status``), None if the cache does not know it."""
    out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--json", "--cache-dir", CACHE_DIR],
                         capture_output=True, text=True, timeout=120)
    got = [d for d in json.loads(out.stdout).get("datasets", []) if d["url"] == url] if out.returncode == 0 else []
    return got[0].get("pinned_by") if got else None


def status(cluster) -> dict:
    return cluster.get("cachedataset", "warm-me").get("status") or {}


def test_a_cachedataset_is_warmed_by_the_agent_and_its_status_follows_the_cache(cluster):
    url, want = cold_dataset(cluster, "cds-warm")
    cluster.apply(  # least privilege: the node agents may read this one Secret, in this namespace only
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "cachefs-warm-credentials", "namespace": "default"},
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["dataset-credentials"],
                    "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "cachefs-warm-credentials", "namespace": "default"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cachefs-warm-credentials"},
         "subjects": [{"kind": "ServiceAccount", "name": "cachefs-node", "namespace": "cachefs-system"}]})
    cluster.apply({"apiVersion": "cachefs.io/v1alpha1", "kind": "CacheDataset",
                   "metadata": {"name": "warm-me", "namespace": "default"},
                   "spec": {"url": url, "endpointUrl": cluster.s3.endpoint, "region": "us-east-1",
                            "credentialsSecret": "dataset-credentials", "warmup": {"enabled": True}, "pin": True}})
    cluster.wait(lambda: status(cluster).get("phase") == "Ready", "the dataset warmed and Ready", 240)
    st = status(cluster)
    REPORT["CacheDataset warmed by the agent"] = (
        f"{st['size']}, {st['files']} files, cached {st['cachedPercentage']}, warm-up {st['warmup']['progress']}, "
        f"errors {st['warmup']['errors']}")
    assert st["cachedPercentage"] == "100.0%" and st["files"] == len(want)
    assert st["warmup"]["progress"] == f"{len(want)}/{len(want)} files" and st["warmup"]["errors"] == 0
    table = cluster.kubectl("get", "cachedatasets", "warm-me")
    assert "100.0%" in table and "Ready" in table and url in table, table
    # A pod reading it now, its volume naming the dataset (kubelet passes the pod's namespace; the node plugin reads
    # the object and its Secret), is served from the node's cache: nothing asked of the origin.
    gets = origin_gets_under(cluster, url)
    start_reader(cluster, "cds-reader", url, want, pace=0.0, dataset="warm-me")
    read = reader_result(cluster, "cds-reader")
    cluster.delete_pod("cds-reader")
    assert read["errors"] == 0 and read["wrong"] == 0 and origin_gets_under(cluster, url) == gets
    # spec.pin: the agent keeps the dataset from eviction on its node (cachefs status says who pins it).
    cluster.wait(lambda: node_pins(url) == ["cachedatasets"], "the agent's pin on the node", 60)
    # Evicted from the node's disk (an explicit purge takes a pinned dataset too): the status follows (it never
    # claims bytes that are not there).
    out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "evict", url, "--cache-dir", CACHE_DIR],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cluster.wait(lambda: status(cluster).get("cachedBytes", 1) == 0, "the status after the eviction", 180)
    REPORT["CacheDataset after `cachefs evict` on the node"] = json.dumps(
        {k: status(cluster).get(k) for k in ("phase", "cachedBytes", "cachedPercentage")})
    cluster.kubectl("delete", "cachedataset", "warm-me")
    cluster.wait(lambda: not node_pins(url), "the pin gone with the dataset", 60)

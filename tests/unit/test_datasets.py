"""CacheDataset status from the node agents' accounting (src/scheduler_hints/datasets.py): what the cluster's caches
hold of a dataset, per node and per cache group, its phase, rate and ETA. The controller against a real API server:
tests/e2e/test_datasets.py."""

from __future__ import annotations

import json

from cachefs.base.types import dataset_id
from scheduler_hints.datasets import dataset_status

URL = "s3://bucket/imagenet"
ID = dataset_id(URL)


def node(name: str, *, group: str = "", cached: int | None = None, total: int = 1000, guest: int = 0,
         files: int = 10, version: int = 1, labels: dict | None = None) -> dict:
    ann = {}
    if cached is not None:
        ann[f"ds.cachefs.io/{ID}"] = json.dumps({"url": URL, "cachedBytes": cached, "totalBytes": total,
                                                 "guestBytes": guest, "totalFiles": files, "manifestVersion": version})
    lab = dict(labels or {})
    if group:
        lab["cachefs.io/cache-group"] = group
    return {"metadata": {"name": name, "labels": lab, "annotations": ann}}


def dataset(spec: dict | None = None, status: dict | None = None) -> dict:
    return {"metadata": {"name": "imagenet", "namespace": "ml", "generation": 3},
            "spec": {"url": URL, **(spec or {})}, "status": status or {}}


def test_a_dataset_no_node_holds_is_pending_with_nothing_claimed():
    st = dataset_status(dataset(), [node("a"), node("b", group="g1")], now=1000.0)
    assert st["phase"] == "Pending" and st["cachedBytes"] == 0 and st["nodes"] == [] and st["size"] == ""
    assert st["observedGeneration"] == 3 and st["conditions"][0]["status"] == "False"


def test_a_group_counts_each_byte_once_and_a_node_its_own_disk():
    nodes = [node("a", group="g1", cached=600, guest=100), node("b", group="g1", cached=500),
             node("c", group="g2", cached=300), node("d", cached=50)]
    st = dataset_status(dataset({"cacheGroup": "g1"}), nodes, now=1000.0)
    assert st["phase"] == "Ready" and st["cachedBytes"] == 1000 and st["cachedPercentage"] == "100.0%"
    assert st["files"] == 10 and st["totalBytes"] == 1000 and st["size"] == "1000 B"
    assert {n["name"]: n["cachedBytes"] for n in st["nodes"]} == {"a": 600, "b": 500, "c": 300, "d": 50}
    assert {g["name"]: g["cachedBytes"] for g in st["groups"]} == {"g1": 1000, "g2": 300}
    other = dataset_status(dataset({"cacheGroup": "g2"}), nodes, now=1000.0)
    assert other["phase"] == "Partial" and other["cachedPercentage"] == "30.0%"


def test_never_more_than_the_agents_counted_nor_more_than_the_dataset():
    """The juicefs#4201 failure the other way round: a status claiming bytes no node has. Here every figure is a
    node agent's count of what its index holds, and a group's guest copies are not counted twice."""
    nodes = [node("a", group="g1", cached=900, guest=900), node("b", group="g1", cached=0)]
    assert dataset_status(dataset({"cacheGroup": "g1"}), nodes, now=1.0)["cachedBytes"] == 0
    over = [node("a", cached=5000, total=1000)]
    assert dataset_status(dataset(), over, now=1.0)["cachedBytes"] == 1000


def test_a_node_selector_places_it_and_the_best_node_counts():
    nodes = [node("a", cached=700, labels={"gpu": "h200"}), node("b", cached=900, labels={"gpu": "a100"})]
    st = dataset_status(dataset({"nodeSelector": {"gpu": "h200"}}), nodes, now=1.0)
    assert st["cachedBytes"] == 700
    assert dataset_status(dataset(), nodes, now=1.0)["cachedBytes"] == 900  # no placement: the best one


def test_a_warm_up_under_way_has_a_rate_and_an_eta_from_samples_30_s_apart():
    spec = {"cacheGroup": "g1", "warmup": {"enabled": True}}
    first = dataset_status(dataset(spec), [node("a", group="g1", cached=100)], now=1000.0)
    assert first["phase"] == "Warming" and first["rate"] == "" and first["eta"] == ""
    soon = dataset_status(dataset(spec, first), [node("a", group="g1", cached=200)], now=1010.0)
    assert soon["rate"] == "" and soon["sampledBytes"] == 100  # (10 s is too short to sample)
    later = dataset_status(dataset(spec, first), [node("a", group="g1", cached=400)], now=1030.0)
    assert later["rateBytesPerSecond"] == 10 and later["eta"] == "60s"
    done = dataset_status(dataset(spec, later), [node("a", group="g1", cached=1000)], now=1060.0)
    assert done["phase"] == "Ready" and done["eta"] == "" and done["conditions"][0]["status"] == "True"


def test_a_url_that_names_no_dataset_fails_with_the_reason():
    st = dataset_status({"metadata": {}, "spec": {"url": "nowhere"}}, [], now=1.0)
    assert st["phase"] == "Failed" and "spec.url" in st["reason"]


def test_the_warm_up_progress_of_each_node_adds_up_and_a_failure_says_where_and_why():
    def warming(name: str, state: str, done: int, total: int, reason: str = "") -> dict:
        n = node(name, group="g1", cached=done * 10)
        n["metadata"]["annotations"][f"warm.cachefs.io/{ID}"] = json.dumps(
            {"state": state, "filesDone": done, "filesTotal": total, "bytesDone": done * 10,
             "bytesTotal": total * 10, "errors": 0, "reason": reason})
        return n

    spec = {"cacheGroup": "g1", "warmup": {"enabled": True}}
    st = dataset_status(dataset(spec), [warming("a", "running", 20, 50), warming("b", "done", 50, 50)], now=1.0)
    assert st["phase"] == "Warming" and st["warmup"]["progress"] == "70/100 files"
    assert st["warmup"]["state"] == "running" and st["warmup"]["bytesDone"] == 700
    bad = dataset_status(dataset(spec), [warming("a", "failed", 20, 50, "403 Forbidden: secrets"),
                                        warming("b", "done", 50, 50)], now=1.0)
    assert bad["phase"] == "Failed" and "a: 403 Forbidden" in bad["reason"]
    off = dataset_status(dataset({"cacheGroup": "g1"}), [warming("a", "running", 20, 50)], now=1.0)
    assert "warmup" not in off and off["phase"] == "Partial"


def test_a_dataset_still_being_listed_for_its_warm_up_is_listing_with_the_files_found_so_far():
    """No node holds a manifest yet, but a node's warm-up is listing the origin: the phase says Listing (with the
    files found so far), not Pending; once a node holds some of it, the usual phases."""
    def listing(name: str, listed: int) -> dict:
        n = node(name, group="g1")
        n["metadata"]["annotations"][f"warm.cachefs.io/{ID}"] = json.dumps(
            {"state": "listing", "filesDone": 0, "filesTotal": 0, "bytesDone": 0, "bytesTotal": 0, "errors": 0,
             "reason": "", "filesListed": listed})
        return n

    spec = {"cacheGroup": "g1", "warmup": {"enabled": True}}
    st = dataset_status(dataset(spec), [listing("a", 120_000), listing("b", 90_000)], now=1.0)
    assert st["phase"] == "Listing" and st["listedFiles"] == 120_000 and st["warmup"]["state"] == "listing"
    assert st["size"] == "" and st["cachedBytes"] == 0  # (nothing claimed before a manifest says what there is)
    held = listing("b", 90_000)
    held["metadata"]["annotations"].update(node("b", group="g1", cached=100)["metadata"]["annotations"])
    assert dataset_status(dataset(spec), [listing("a", 120_000), held], now=1.0)["phase"] == "Warming"

from __future__ import annotations

import json

import pytest

from cachefs.base.types import dataset_id
from scheduler_hints.labels import (
    FREE_LABEL,
    GROUP_LABEL,
    NODE_ANNOTATION,
    DatasetCache,
    LabelError,
    NodeCacheSummary,
    bucket_with_hysteresis,
    dataset_key,
    desired_metadata,
    fraction_bucket,
    read_node,
    validate_label_key,
    validate_label_value,
)


@pytest.mark.parametrize(("cached", "total", "bucket"), [
    (0, 100, 0), (4, 100, 0), (5, 100, 5), (99, 100, 95), (100, 100, 100), (150, 100, 100), (0, 0, 100),
    (999_999, 1_000_000, 95), (-3, 100, 0),
])
def test_fraction_bucket(cached, total, bucket):
    assert fraction_bucket(cached, total) == bucket


@pytest.mark.parametrize(("cached", "prev", "want"), [
    (50, None, 50), (49.5, 50, 50),  # just under the boundary: keep 50
    (48, 50, 45),  # clearly below: move
    (55.5, 50, 50), (56.5, 50, 55), (100, 95, 100), (0, 50, 0),
])
def test_hysteresis(cached, prev, want):
    total = 10_000
    assert bucket_with_hysteresis(int(cached * 100), total, prev) == want


def test_keys_are_short_and_valid_for_any_url():
    long_url = "s3://bucket/" + "x" * 2000 + "/ünïcödé dir"
    key = dataset_key(dataset_id(long_url))
    assert validate_label_key(key) == key
    assert len(key.split("/", 1)[1]) == 16
    with pytest.raises(LabelError):
        dataset_key("not-a-hash")


@pytest.mark.parametrize("bad", ["-x", "x" * 64, "a b", "ä", "x-"])
def test_invalid_values_are_refused(bad):
    with pytest.raises(LabelError):
        validate_label_value(bad)


def test_desired_metadata_and_read_back_round_trip():
    a, b = dataset_id("s3://b/a"), dataset_id("s3://b/b")
    summary = NodeCacheSummary((DatasetCache("s3://b/a", a, 900, 1000, 3), DatasetCache("s3://b/b", b, 0, 50)),
                               free_bytes=5 * 2**30 + 7, capacity_bytes=10 * 2**30, used_bytes=900, cache_group="rack-1")
    labels, annotations = desired_metadata(summary, now=0)
    assert labels == {dataset_key(a): "90", GROUP_LABEL: "rack-1", FREE_LABEL: "5"}
    assert json.loads(annotations[dataset_key(a)]) == {
        "url": "s3://b/a", "cachedBytes": 900, "totalBytes": 1000, "guestBytes": 0, "totalFiles": 0, "manifestVersion": 3,
        "updatedAt": "1970-01-01T00:00:00Z"}
    assert json.loads(annotations[NODE_ANNOTATION])["freeBytes"] == 5 * 2**30 + 7
    view = read_node("n1", labels, annotations)
    assert view.fractions == {a: 0.9} and view.cached_bytes == {a: 900}
    assert view.cache_group == "rack-1" and view.free_bytes == 5 * 2**30 + 7


def test_read_node_tolerates_garbage():
    view = read_node("n", {dataset_key("0" * 16): "abc", "other": "x"},
                     {dataset_key("1" * 16): "{not json", NODE_ANNOTATION: "[]"})
    assert view.fractions == {} and view.free_bytes is None
    assert read_node("n", None, None).fractions == {}


def test_bad_cache_group_is_refused():
    with pytest.raises(LabelError):
        desired_metadata(NodeCacheSummary((), 0, 0, 0, cache_group="rack 1"))


def test_a_node_in_a_group_publishes_what_its_group_holds_and_the_extender_prefers_it():
    from scheduler_hints.labels import GROUP_DATASET_PREFIX, group_dataset_key, group_totals, is_ours
    from scheduler_hints.scoring import NodeState, group_fractions

    a, b = dataset_id("s3://b/a"), dataset_id("s3://b/b")
    # Four members each hold a quarter of a (less a bit), and one of them some of b.
    members = {f"n{i}": {a: (240, 1000)} for i in range(4)}
    members["n0"][b] = (10, 100)
    group = group_totals(members)
    assert {d.id: (d.cached_bytes, d.total_bytes) for d in group} == {a: (960, 1000), b: (10, 100)}
    assert group_totals({"x": {a: (700, 1000)}, "y": {a: (700, 1000)}})[0].cached_bytes == 1000  # capped
    summary = NodeCacheSummary((DatasetCache("s3://b/a", a, 240, 1000),), 0, 0, 240, cache_group="rack-1",
                               group_datasets=group)
    labels, annotations = desired_metadata(summary, now=0)
    assert labels[dataset_key(a)] == "20" and labels[group_dataset_key(a)] == "95"
    assert labels[group_dataset_key(b)] == "10"
    assert group_dataset_key(a) == f"{GROUP_DATASET_PREFIX}/{a}" and is_ours(group_dataset_key(a))
    validate_label_key(group_dataset_key(a))
    # Outside a group there is no group label.
    assert not any(k.startswith(GROUP_DATASET_PREFIX) for k in
                   desired_metadata(NodeCacheSummary(summary.datasets, 0, 0, 0, None, group), now=0)[0])
    view = read_node("n0", labels, annotations)
    assert view.group_fractions == {a: 0.95, b: 0.10}
    # The extender takes the group's published fraction; without one, it adds up the members' own.
    published = [NodeState("n0", view), NodeState("n1", read_node("n1", {dataset_key(a): "20", GROUP_LABEL: "rack-1"},
                                                                  {}))]
    assert group_fractions(published)["rack-1"][a] == 0.95
    bare = [NodeState(f"n{i}", read_node(f"n{i}", {dataset_key(a): "20", GROUP_LABEL: "rack-1"}, {})) for i in range(3)]
    assert group_fractions(bare)["rack-1"][a] == pytest.approx(0.6)


def test_members_weigh_their_annotated_cache_capacity():
    """The group's Node watch: a member weighs its cache capacity in GiB (from the label publisher's annotation);
    one not annotated yet weighs the median, so equal disks move nothing when its annotation arrives."""
    from cachefs.cluster.membership import CACHE_ANNOTATION, EndpointSliceWatch, MemberTable

    assert CACHE_ANNOTATION == NODE_ANNOTATION  # the publisher writes what membership reads
    table = MemberTable("n0")
    watch = EndpointSliceWatch(None, "ns", "svc", table, group="g")

    def node(name: str, capacity: int | None, datasets: dict | None = None) -> dict:
        ann = {} if capacity is None else {NODE_ANNOTATION: json.dumps({"capacityBytes": capacity})}
        for ds_id, (c, t) in (datasets or {}).items():  # (each also holds 5 bytes of guest copies)
            ann[dataset_key(ds_id)] = json.dumps({"cachedBytes": c + 5, "guestBytes": 5, "totalBytes": t})
        return {"metadata": {"name": name, "labels": {GROUP_LABEL: "g"}, "annotations": ann}}

    a = dataset_id("s3://b/a")
    for i, cap in enumerate((100 << 30, 100 << 30, None)):
        watch._node_event("ADDED", node(f"n{i}", cap, {a: (10 * (i + 1), 100)}))
    watch._node_event("SYNC", {})
    watch._slice_event("ADDED", {"metadata": {"name": "s"}, "ports": [{"name": "peer", "port": 7480}],
                                 "endpoints": [{"nodeName": f"n{i}", "addresses": [f"10.0.0.{i}"]} for i in range(3)]})
    watch._slice_event("SYNC", {})
    assert {n: m.weight for n, m in table.members.items()} == {"n0": 100.0, "n1": 100.0, "n2": 100.0}
    before = table.placement.slot_owners()
    watch._node_event("MODIFIED", node("n2", 100 << 30))  # its annotation arrives: same weight, nothing moves
    assert (table.placement.slot_owners() == before).all()
    watch._node_event("MODIFIED", node("n2", 400 << 30))  # a bigger disk: it owns more
    assert table.members["n2"].weight == 400.0
    assert table.placement.owned_share("n2") > 0.5
    assert watch.group_datasets() == {"n0": {a: (10, 100)}, "n1": {a: (20, 100)}, "n2": {}}

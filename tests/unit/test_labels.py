from __future__ import annotations

import json

import pytest

from cachefs.types import dataset_id
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
        "url": "s3://b/a", "cachedBytes": 900, "totalBytes": 1000, "manifestVersion": 3,
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

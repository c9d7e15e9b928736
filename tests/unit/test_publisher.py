"""The publisher's patch computation (pure) and kubeconfig loading; the publisher against a real API server
is in tests/e2e."""

from __future__ import annotations

import base64
import json

import pytest

from cachefs.base.errors import ConfigError
from cachefs.kube import load_kube_config
from scheduler_hints.labels import DatasetCache, NodeCacheSummary, dataset_key, desired_metadata
from scheduler_hints.publisher import metadata_patch

DS = "0123456789abcdef"
KEY = dataset_key(DS)
T0 = 1_800_000_000.0


def meta(cached: int, total: int = 10_000, free: int = 5 * 2**30, now: float = T0, prev=None):
    s = NodeCacheSummary((DatasetCache("s3://b/d", DS, cached, total, 1),) if cached else (), free, 10 * 2**30, 0)
    return desired_metadata(s, prev, now=now)


def test_first_publish_sets_everything():
    labels, ann = meta(5_000)
    patch = metadata_patch({"kubernetes.io/hostname": "n"}, {}, labels, ann, now=T0)
    assert patch["labels"][KEY] == "50" and KEY in patch["annotations"]
    assert "kubernetes.io/hostname" not in patch["labels"]  # never touches what is not ours


def test_no_change_no_patch_and_small_moves_do_not_rewrite_annotations():
    labels, ann = meta(5_000)
    assert metadata_patch(labels, ann, labels, ann, now=T0) == {}
    labels2, ann2 = meta(5_050, now=T0 + 60, prev=labels)  # +0.5 % of the dataset, same bucket
    assert metadata_patch(labels, ann, labels2, ann2, now=T0 + 60) == {}
    labels3, ann3 = meta(5_200, now=T0 + 60, prev=labels)  # +2 %: exact figures refreshed, label unchanged
    patch = metadata_patch(labels, ann, labels3, ann3, now=T0 + 60)
    assert "labels" not in patch and json.loads(patch["annotations"][KEY])["cachedBytes"] == 5_200


def test_old_annotations_are_refreshed_and_bucket_changes_rewrite_both():
    labels, ann = meta(5_000)
    later = meta(5_000, now=T0 + 601, prev=labels)
    assert set(metadata_patch(labels, ann, *later, now=T0 + 601)["annotations"]) >= {KEY}
    moved = meta(6_000, now=T0 + 5, prev=labels)
    patch = metadata_patch(labels, ann, *moved, now=T0 + 5)
    assert patch["labels"] == {KEY: "60"} and KEY in patch["annotations"]


def test_datasets_no_longer_held_are_removed():
    labels, ann = meta(5_000)
    gone = meta(0, now=T0 + 5, prev=labels)
    patch = metadata_patch({**labels, "team": "x"}, ann, *gone, now=T0 + 5)
    assert patch["labels"] == {KEY: None} and patch["annotations"][KEY] is None
    assert "team" not in patch["labels"]


def test_kubeconfig_with_inline_data_and_token(tmp_path):
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    path = tmp_path / "config"
    path.write_text(json.dumps({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://10.0.0.1:6443/", "certificate-authority-data": ca}}],
        "users": [{"name": "u", "user": {"token": "t0k"}}]}))
    cfg = load_kube_config(str(path), env={})
    assert cfg.server == "https://10.0.0.1:6443" and cfg.token == "t0k"
    with open(cfg.ca_file, "rb") as f:
        assert f.read() == b"-----BEGIN CERTIFICATE-----\n"


@pytest.mark.parametrize("content", ["", "current-context: nope\n", "[1, 2"])
def test_bad_kubeconfig_is_a_clear_config_error(tmp_path, content):
    path = tmp_path / "config"
    path.write_text(content)
    with pytest.raises(ConfigError, match="kubeconfig"):
        load_kube_config(str(path), env={})


def test_no_cluster_access_at_all_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not in a pod"):
        load_kube_config(None, env={"KUBECONFIG": str(tmp_path / "missing")})

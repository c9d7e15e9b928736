"""Volume attributes that name a CacheDataset instead of a URL (docs/DATASETS.md): accepted as a name in the pod's
namespace, refused clearly otherwise, and carried through the volume id."""

from __future__ import annotations

import pytest

from csi.volume import DatasetVolume, VolumeError


def test_a_dataset_name_stands_for_the_url_until_it_is_resolved():
    vol = DatasetVolume.from_attributes({"dataset": "imagenet", "mode": "0444",
                                         "csi.storage.k8s.io/pod.namespace": "ml"})
    assert (vol.dataset, vol.url, vol.mode) == ("imagenet", "", "0444")
    assert DatasetVolume.from_volume_id(vol.volume_id_for("pvc-1")) == vol
    resolved = vol.for_group(1000).resolved("s3://bucket/imagenet", "http://127.0.0.1:9000", "us-east-1")
    assert (resolved.url, resolved.endpoint_url, resolved.region, resolved.mode, resolved.group, resolved.dataset) == (
        "s3://bucket/imagenet", "http://127.0.0.1:9000", "us-east-1", "0444", 1000, "")
    # the same session as a volume giving the URL itself
    assert resolved.session_key == DatasetVolume("s3://bucket/imagenet", "http://127.0.0.1:9000", "us-east-1",
                                                 "0444", group=1000).session_key


@pytest.mark.parametrize(("attrs", "said"), [
    ({"dataset": "imagenet", "url": "s3://b/p"}, "either 'dataset' or 'url'"),
    ({"dataset": "imagenet", "endpointUrl": "http://x"}, "either 'dataset' or 'url'"),
    ({"dataset": "other-namespace/imagenet"}, "without a namespace"),
    ({"dataset": "ImageNet"}, "not a Kubernetes object name"),
    ({"dataset": "x" * 254}, "not a Kubernetes object name"),
    ({"dataset": "imagenet", "writable": "true"}, "read-only"),
    ({"dataset": "imagenet", "mode": "0777"}, "mode"),
    ({"region": "us-east-1"}, "'url'"),
])
def test_bad_dataset_attributes_are_refused_clearly(attrs, said):
    with pytest.raises(VolumeError, match=said):
        DatasetVolume.from_attributes(attrs)


def test_a_dataset_whose_url_is_bad_is_refused_when_resolved():
    with pytest.raises(VolumeError, match="not a URL"):
        DatasetVolume.from_attributes({"dataset": "imagenet"}).resolved("imagenet", "", "")

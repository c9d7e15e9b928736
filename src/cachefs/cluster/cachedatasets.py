"""The CacheDataset object's contract between the node agents (which warm datasets up and say how far they got) and
the dataset controller (which writes the objects' status): where the objects are, which nodes a dataset is placed
on, and the Node annotation that carries one node's warm-up progress (docs/DATASETS.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachefs.cluster.membership import GROUP_LABEL

__all__ = ["API", "WARM_PREFIX", "placed_on", "warm_key"]

#: The CacheDataset API (deploy/base/cachedataset-crd.yaml).
API = "/apis/cachefs.io/v1alpha1"
#: ``warm.cachefs.io/<dataset id>``: a node's warm-up progress, JSON (``state`` running, done or failed,
#: ``filesDone``, ``filesTotal``, ``bytesDone``, ``bytesTotal``, ``errors``, ``reason``).
WARM_PREFIX = "warm.cachefs.io"


def warm_key(ds_id: str) -> str:
    return f"{WARM_PREFIX}/{ds_id}"


def placed_on(spec: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Whether ``node`` is among a CacheDataset's placement (``cacheGroup``, ``nodeSelector``; every node without)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    group = spec.get("cacheGroup")
    if group and labels.get(GROUP_LABEL) != group:
        return False
    return all(labels.get(k) == v for k, v in (spec.get("nodeSelector") or {}).items())

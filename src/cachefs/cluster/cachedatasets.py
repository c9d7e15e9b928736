"""The CacheDataset object's contract between the node agents (which warm datasets up and say how far they got) and
the dataset controller (which writes the objects' status): where the objects are, which nodes a dataset is placed
on, and the Node annotation that carries one node's warm-up progress (docs/DATASETS.md)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from cachefs.cluster.membership import GROUP_LABEL

__all__ = ["API", "WARM_FOR", "WARM_PREFIX", "placed_on", "secret_credentials", "warm_key"]

#: The CacheDataset API (deploy/base/cachedataset-crd.yaml).
API = "/apis/cachefs.io/v1alpha1"
#: ``warm.cachefs.io/<dataset id>``: a node's warm-up progress, JSON (``state`` running, done or failed,
#: ``filesDone``, ``filesTotal``, ``bytesDone``, ``bytesTotal``, ``errors``, ``reason``).
WARM_PREFIX = "warm.cachefs.io"
#: The ConfigMap the scheduler extender writes (scheduler_hints.prewarm): per cache group, a JSON list of the dataset
#: URLs to warm there, for pending gangs that will land in it.
WARM_FOR = "/api/v1/namespaces/cachefs-system/configmaps/cachefs-warm-for"


def warm_key(ds_id: str) -> str:
    return f"{WARM_PREFIX}/{ds_id}"


def placed_on(spec: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Whether ``node`` is among a CacheDataset's placement (``cacheGroup``, ``nodeSelector``; every node without)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    group = spec.get("cacheGroup")
    if group and labels.get(GROUP_LABEL) != group:
        return False
    return all(labels.get(k) == v for k, v in (spec.get("nodeSelector") or {}).items())


def secret_credentials(secret: Mapping[str, Any]) -> dict[str, str]:
    """The origin credentials in a CacheDataset's ``credentialsSecret`` (an API Secret object: ``awsAccessKeyID``,
    ``awsSecretAccessKey``, optionally ``awsSessionToken``) as AWS environment variables; ValueError if it lacks them."""
    meta = secret.get("metadata") or {}
    data = secret.get("data") or {}
    try:
        out = {"AWS_ACCESS_KEY_ID": base64.b64decode(data["awsAccessKeyID"]).decode(),
               "AWS_SECRET_ACCESS_KEY": base64.b64decode(data["awsSecretAccessKey"]).decode()}
        if data.get("awsSessionToken"):
            out["AWS_SESSION_TOKEN"] = base64.b64decode(data["awsSessionToken"]).decode()
    except (KeyError, ValueError, binascii.Error) as exc:
        raise ValueError(f"Secret {meta.get('namespace', '?')}/{meta.get('name', '?')} lacks awsAccessKeyID / "
                         "awsSecretAccessKey") from exc
    return out

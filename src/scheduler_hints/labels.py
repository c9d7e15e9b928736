"""The label contract between node agents (which publish) and the scheduler extender (which reads).

Per node and dataset
    label       ``ds.cachefs.io/<dataset id>: "<bucket>"`` — the cached fraction in percent, rounded down to a
                multiple of ``BUCKET_STEP`` (0, 5, …, 100), so a node that is filling up changes its label at
                most 20 times per dataset.
    annotation  ``ds.cachefs.io/<dataset id>`` — JSON with the exact figures: ``url``, ``cachedBytes``,
                ``totalBytes``, ``guestBytes``, ``totalFiles``, ``manifestVersion``, ``updatedAt`` (RFC 3339).
    label       ``group.cachefs.io/<dataset id>: "<bucket>"`` — on a node in a cache group, the fraction of the
                dataset its group holds (the members' cached bytes added up: a group keeps each byte once,
                docs/CLUSTER.md), in the same buckets: what a pod on this node reads from its node or a peer
                instead of object storage. Plain node affinity can use it (``Gt``) without the extender.
Per node
    label       ``cachefs.io/cache-group: <group>`` — the node's cache group (rack, cell), when configured;
    label       ``cachefs.io/free-gib: "<n>"`` — free cache space, whole GiB (coarse on purpose);
    annotation  ``cachefs.io/cache`` — JSON: ``freeBytes``, ``capacityBytes``, ``usedBytes``, ``updatedAt``.

Names: the dataset id is 16 lowercase hex digits (a hash of the canonical dataset URL, see
:func:`cachefs.base.types.dataset_id`), so every key is short and valid whatever the URL: a long or odd URL never
appears in a key or label value, only inside the annotation's JSON. Keys and values are checked against
Kubernetes' rules (qualified names: a DNS-subdomain prefix of ≤ 253 characters and a name of ≤ 63
characters; label values ≤ 63 characters of ``[A-Za-z0-9._-]`` starting and ending alphanumeric); a cache
group name that breaks them is refused at start-up with a clear error rather than silently mangled.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

__all__ = [
    "BUCKET_STEP",
    "DATASET_PREFIX",
    "FREE_LABEL",
    "GROUP_DATASET_PREFIX",
    "GROUP_LABEL",
    "NODE_ANNOTATION",
    "DatasetCache",
    "LabelError",
    "NodeCacheSummary",
    "NodeCacheView",
    "bucket_with_hysteresis",
    "dataset_key",
    "desired_metadata",
    "fraction_bucket",
    "group_dataset_key",
    "group_totals",
    "read_dataset_annotation",
    "read_node",
    "rfc3339",
    "validate_label_key",
    "validate_label_value",
]

DATASET_PREFIX = "ds.cachefs.io"
GROUP_DATASET_PREFIX = "group.cachefs.io"
GROUP_LABEL = "cachefs.io/cache-group"
FREE_LABEL = "cachefs.io/free-gib"
NODE_ANNOTATION = "cachefs.io/cache"
BUCKET_STEP = 5

_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DATASET_ID = re.compile(r"^[0-9a-f]{16}$")


class LabelError(ValueError):
    """A label key or value that Kubernetes would reject."""


def validate_label_key(key: str) -> str:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        raise LabelError(f"label key {key!r}: prefix must be a DNS subdomain of at most 253 characters")
    if not name or len(name) > 63 or not _NAME.match(name):
        raise LabelError(f"label key {key!r}: name must be 1–63 characters of [A-Za-z0-9._-], "
                         "starting and ending alphanumeric")
    return key


def validate_label_value(value: str) -> str:
    if value and (len(value) > 63 or not _NAME.match(value)):
        raise LabelError(f"label value {value!r}: must be at most 63 characters of [A-Za-z0-9._-], "
                         "starting and ending alphanumeric")
    return value


def dataset_key(ds_id: str) -> str:
    """The label and annotation key of one dataset."""
    if not _DATASET_ID.match(ds_id):
        raise LabelError(f"dataset id {ds_id!r}: expected 16 lowercase hex digits")
    return f"{DATASET_PREFIX}/{ds_id}"


def group_dataset_key(ds_id: str) -> str:
    """The label key of the fraction of one dataset a node's cache group holds."""
    return f"{GROUP_DATASET_PREFIX}/{dataset_key(ds_id).split('/', 1)[1]}"


def group_totals(members: dict[str, dict[str, tuple[int, int]]]) -> tuple[DatasetCache, ...]:
    """What a cache group holds per dataset, from what each member owns ({node: {id: (owned, total)}}, owned:
    cached less guest copies): added up, as members own disjoint shares (at most the total, the largest any
    member reports)."""
    cached: dict[str, int] = {}
    total: dict[str, int] = {}
    for per in members.values():
        for ds_id, (c, t) in per.items():
            cached[ds_id] = cached.get(ds_id, 0) + max(0, c)
            total[ds_id] = max(total.get(ds_id, 0), t)
    return tuple(DatasetCache("", d, min(cached[d], total[d]) if total[d] else cached[d], total[d])
                 for d in sorted(cached))


def fraction_bucket(cached: int, total: int, step: int = BUCKET_STEP) -> int:
    """Cached percentage rounded down to a multiple of ``step``; 100 only when everything is cached."""
    if total <= 0:
        return 100
    if cached >= total:
        return 100
    pct = 100 * max(0, cached) / total
    return min(100 - step, int(pct // step) * step)


def bucket_with_hysteresis(cached: int, total: int, previous: int | None, step: int = BUCKET_STEP,
                           margin: float = 1.0) -> int:
    """Like :func:`fraction_bucket`, but keep ``previous`` while the exact percentage is within ``margin``
    points of its bucket's range, so a fraction hovering on a boundary does not flap the label."""
    new = fraction_bucket(cached, total, step)
    if previous is None or new == previous or new == 100 or (total > 0 and cached <= 0):
        return new
    pct = 100 * cached / total if total > 0 else 100.0
    if previous - margin <= pct < previous + step + margin:
        return previous
    return new


@dataclass(frozen=True)
class DatasetCache:
    """What one node holds of one dataset (the index summary the publisher reads)."""

    url: str
    id: str
    cached_bytes: int
    total_bytes: int
    manifest_version: int = 0
    #: Of the cached bytes, guest data: copies of what other members of its cache group own.
    guest_bytes: int = 0
    #: Files in the manifest the node holds (0: not known).
    total_files: int = 0


@dataclass(frozen=True)
class NodeCacheSummary:
    datasets: tuple[DatasetCache, ...]
    free_bytes: int
    capacity_bytes: int
    used_bytes: int
    cache_group: str | None = None
    #: What the node's cache group holds per dataset (empty outside a group or without its members' figures).
    group_datasets: tuple[DatasetCache, ...] = ()


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bucket_label(d: DatasetCache, previous: str | None) -> str:
    """The label value of ``d``'s cached fraction, kept at ``previous`` within the hysteresis margin."""
    prev_bucket = int(previous) if previous is not None and previous.isdigit() else None
    return str(bucket_with_hysteresis(d.cached_bytes, d.total_bytes, prev_bucket))


def desired_metadata(summary: NodeCacheSummary, previous_labels: dict[str, str] | None = None,
                     now: float | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The cachefs labels and annotations a node holding ``summary`` publishes.

    ``previous_labels`` (the node's current labels) feeds the hysteresis. Datasets with nothing cached get
    no label (the extender reads a missing label as 0 %).
    """
    now = time.time() if now is None else now
    previous_labels = previous_labels or {}
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    for d in summary.datasets:
        if d.cached_bytes <= 0:
            continue
        key = dataset_key(d.id)
        labels[key] = _bucket_label(d, previous_labels.get(key))
        annotations[key] = json.dumps({
            "url": d.url, "cachedBytes": d.cached_bytes, "totalBytes": d.total_bytes, "guestBytes": d.guest_bytes,
            "totalFiles": d.total_files, "manifestVersion": d.manifest_version, "updatedAt": rfc3339(now),
        }, separators=(",", ":"), sort_keys=True)
    if summary.cache_group:
        labels[GROUP_LABEL] = validate_label_value(summary.cache_group)
        for d in summary.group_datasets:
            if d.cached_bytes <= 0:
                continue
            key = group_dataset_key(d.id)
            labels[key] = _bucket_label(d, previous_labels.get(key))
    labels[FREE_LABEL] = str(max(0, summary.free_bytes) // 2**30)
    annotations[NODE_ANNOTATION] = json.dumps({
        "freeBytes": summary.free_bytes, "capacityBytes": summary.capacity_bytes, "usedBytes": summary.used_bytes,
        "updatedAt": rfc3339(now),
    }, separators=(",", ":"), sort_keys=True)
    for k, v in labels.items():
        validate_label_key(k)
        validate_label_value(v)
    return labels, annotations


def is_ours(key: str) -> bool:
    return (key.startswith((DATASET_PREFIX + "/", GROUP_DATASET_PREFIX + "/"))
            or key in (GROUP_LABEL, FREE_LABEL, NODE_ANNOTATION))


@dataclass(frozen=True)
class NodeCacheView:
    """What the extender reads back from a node: cached fraction (0–1) and bytes per dataset id."""

    name: str
    fractions: dict[str, float] = field(default_factory=dict)
    cached_bytes: dict[str, int] = field(default_factory=dict)
    cache_group: str | None = None
    free_bytes: int | None = None
    #: The fraction of each dataset the node's cache group holds, as the node published it.
    group_fractions: dict[str, float] = field(default_factory=dict)


def read_dataset_annotation(ds_id: str, value: str) -> DatasetCache | None:
    """The figures of a ``ds.cachefs.io/<ds_id>`` annotation (negative counts read as 0), or None if malformed."""
    try:
        d = json.loads(value)
        return DatasetCache(str(d.get("url", "")), ds_id, max(0, int(d["cachedBytes"])), max(0, int(d["totalBytes"])),
                            int(d.get("manifestVersion", 0)), max(0, int(d.get("guestBytes", 0))),
                            max(0, int(d.get("totalFiles", 0))))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_node(name: str, labels: dict[str, str] | None, annotations: dict[str, str] | None) -> NodeCacheView:
    """Parse a node's cachefs labels/annotations. Exact annotation figures win over the coarse label;
    anything malformed is ignored (treated as nothing cached), never an error."""
    labels, annotations = labels or {}, annotations or {}
    fractions: dict[str, float] = {}
    cached: dict[str, int] = {}
    group: dict[str, float] = {}
    for key, value in labels.items():
        if key.startswith(DATASET_PREFIX + "/") and value.isdigit():
            fractions[key.split("/", 1)[1]] = min(100, int(value)) / 100
        elif key.startswith(GROUP_DATASET_PREFIX + "/") and value.isdigit():
            group[key.split("/", 1)[1]] = min(100, int(value)) / 100
    for key, value in annotations.items():
        if not key.startswith(DATASET_PREFIX + "/"):
            continue
        ds_id = key.split("/", 1)[1]
        d = read_dataset_annotation(ds_id, value)
        if d is None:
            continue
        cached[ds_id] = d.cached_bytes
        fractions[ds_id] = min(1.0, d.cached_bytes / d.total_bytes) if d.total_bytes > 0 else 1.0
    free = None
    try:
        free = int(json.loads(annotations.get(NODE_ANNOTATION, "{}")).get("freeBytes"))
    except (ValueError, TypeError, AttributeError):
        free = None
    return NodeCacheView(name, fractions, cached, labels.get(GROUP_LABEL), free, group)

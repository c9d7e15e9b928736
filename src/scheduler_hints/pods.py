"""Reading what a pod needs out of a Pod object as kube-scheduler sends it (plain JSON, Go field names for
the extender envelope but normal Kubernetes JSON inside)."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cachefs.base.errors import InvalidURLError
from cachefs.base.types import dataset_id

__all__ = [
    "CSI_DRIVER",
    "DATASETS_ANNOTATION",
    "GPU_RESOURCE",
    "WAIT_WARM_ANNOTATION",
    "WARM_READY_ANNOTATION",
    "GangRef",
    "StaticVolumes",
    "VolumeIndex",
    "field_of",
    "pod_dataset_urls",
    "pod_datasets",
    "pod_gang",
    "pod_gpus",
    "pod_key",
    "pod_wait_warm",
    "volume_dataset",
]

CSI_DRIVER = "csi.cachefs.io"
DATASETS_ANNOTATION = "cachefs.io/datasets"
GPU_RESOURCE = "nvidia.com/gpu"
#: Gang membership, in the order they are consulted.
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"  # scheduler-plugins
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"  # Volcano
KAI_ANNOTATION = "pod-group-name"  # NVIDIA KAI scheduler (its PodGroup: scheduling.run.ai)
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"  # Kueue's plain-pod groups
KUEUE_GROUP_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"  # pods of a workload Kueue admitted (Job, JobSet …)
KUEUE_TAS_LABEL = "kueue.x-k8s.io/tas"  # … placed by Kueue's topology-aware scheduling
GANG_ANNOTATION = "cachefs.io/gang"  # ours
#: A pod (or gang) that should not start before this percentage of its data is cached where it lands.
WAIT_WARM_ANNOTATION = "cachefs.io/wait-warm"
#: Set by the extender on a pod that waited for warm data once a node it could run on holds enough of it (the time,
#: RFC 3339): the pod's update has kube-scheduler try it again at once.
WARM_READY_ANNOTATION = "cachefs.io/warm-ready"
GANG_SIZE_ANNOTATION = "cachefs.io/gang-size"
#: Volume attribute keys that carry the dataset (PV spec.csi.volumeAttributes or inline csi.volumeAttributes): its URL,
#: or the name of a CacheDataset in the pod's namespace (a ``dataset`` value with ``://`` is read as a URL, as before
#: CacheDatasets existed).
URL_ATTRIBUTES = ("url", "dataset")


def volume_dataset(attrs: Any, namespace: str, volumes: VolumeIndex | None) -> str | None:
    """The dataset URL a cachefs volume's attributes name, in ``namespace`` (a CacheDataset's name resolved through
    ``volumes``), else None."""
    if not isinstance(attrs, Mapping):
        return None
    if attrs.get("url"):
        return str(attrs["url"])
    name = attrs.get("dataset")
    if not name:
        return None
    if "://" in str(name):
        return str(name)
    return volumes.dataset_url(namespace, str(name)) if volumes is not None else None


class VolumeIndex(abc.ABC):
    """PVC → dataset URL, from a watch cache of PVCs and PVs (never an API call per request)."""

    @abc.abstractmethod
    def claim_dataset(self, namespace: str, claim: str) -> str | None:
        """The dataset URL behind a PVC bound to a cachefs PV, else None."""

    def dataset_url(self, namespace: str, name: str) -> str | None:
        """The URL of CacheDataset ``namespace/name``, else None (no such object, or not watched)."""
        return None


class StaticVolumes(VolumeIndex):
    def __init__(self, claims: Mapping[tuple[str, str], str] | None = None) -> None:
        self.claims = dict(claims or {})

    def claim_dataset(self, namespace: str, claim: str) -> str | None:
        return self.claims.get((namespace, claim))


def field_of(obj: Any, key: str) -> Mapping[str, Any]:
    """``obj[key]`` when both are mappings, else an empty one (objects from the API server are read defensively)."""
    value = obj.get(key) if isinstance(obj, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return field_of(pod, "metadata")


def pod_key(pod: Mapping[str, Any]) -> str:
    m = _meta(pod)
    return str(m.get("uid") or f"{m.get('namespace', 'default')}/{m.get('name', '')}")


def pod_datasets(pod: Mapping[str, Any], volumes: VolumeIndex | None = None) -> list[str]:
    """Dataset ids the pod reads: its cachefs CSI volumes (inline or PVC) and the ``cachefs.io/datasets``
    annotation. Unparseable URLs are skipped (the pod is scored as if it read nothing from them)."""
    ids: list[str] = []
    for url in pod_dataset_urls(pod, volumes):
        try:
            ds = dataset_id(url)
        except InvalidURLError:
            continue
        if ds not in ids:
            ids.append(ds)
    return ids


def pod_dataset_urls(pod: Mapping[str, Any], volumes: VolumeIndex | None = None) -> list[str]:
    """The URLs of what :func:`pod_datasets` counts, as the pod (or its claims) gives them."""
    urls: list[str] = []
    meta = _meta(pod)
    ann = meta.get("annotations") or {}
    if isinstance(ann, Mapping) and isinstance(ann.get(DATASETS_ANNOTATION), str):
        urls += [u.strip() for u in ann[DATASETS_ANNOTATION].split(",") if u.strip()]
    raw_spec = pod.get("spec")
    spec: Mapping[str, Any] = raw_spec if isinstance(raw_spec, Mapping) else {}
    namespace = str(meta.get("namespace") or "default")
    for vol in spec.get("volumes") or ():
        if not isinstance(vol, Mapping):
            continue
        csi = vol.get("csi")
        if isinstance(csi, Mapping) and csi.get("driver") == CSI_DRIVER:
            url = volume_dataset(csi.get("volumeAttributes"), namespace, volumes)
            if url:
                urls.append(url)
        pvc = vol.get("persistentVolumeClaim")
        if isinstance(pvc, Mapping) and pvc.get("claimName") and volumes is not None:
            url = volumes.claim_dataset(namespace, str(pvc["claimName"]))
            if url:
                urls.append(url)
    return urls


#: More of a resource than any node has: a larger request is this many (it fits nowhere), so that arithmetic
#: on it stays within 64-bit arrays (a request of 10**23 GPUs was an OverflowError and a 500).
MAX_QUANTITY = 1 << 40


def pod_wait_warm(pod: Mapping[str, Any]) -> float | None:
    """The share (0–1] of its data the pod waits to see cached where it lands (``cachefs.io/wait-warm``, a
    percentage), or None: not asked, or not a number in (0, 100]."""
    raw = (_meta(pod).get("annotations") or {}).get(WAIT_WARM_ANNOTATION)
    try:
        share = float(str(raw).strip().rstrip("%")) / 100 if raw is not None else None
    except ValueError:
        return None
    return share if share is not None and 0 < share <= 1 else None


def _quantity(value: Any) -> int:
    try:
        return min(max(0, int(str(value))), MAX_QUANTITY)
    except ValueError:
        return 0


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """GPUs the pod requests (``nvidia.com/gpu`` limits or requests; init containers by their maximum)."""
    raw_spec = pod.get("spec")
    spec: Mapping[str, Any] = raw_spec if isinstance(raw_spec, Mapping) else {}

    def per(container: Any) -> int:
        res = container.get("resources") if isinstance(container, Mapping) else None
        if not isinstance(res, Mapping):
            return 0
        for part in ("limits", "requests"):
            q = (res.get(part) or {}).get(GPU_RESOURCE) if isinstance(res.get(part), Mapping) else None
            if q is not None:
                return _quantity(q)
        return 0

    def listed(key: str) -> list:
        value = spec.get(key)
        return value if isinstance(value, list) else []

    main = sum(per(c) for c in listed("containers"))
    init = max((per(c) for c in listed("initContainers")), default=0)
    return max(main, init)


@dataclass(frozen=True)
class GangRef:
    namespace: str
    name: str
    min_member: int
    #: Kueue's topology-aware scheduling chose the gang's domains (the pods carry its node selectors): the
    #: extender admits it all-or-nothing but does not wait for other domains or for its data elsewhere.
    topology_assigned: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_gang(pod: Mapping[str, Any], min_members: Mapping[str, int] | None = None) -> GangRef | None:
    """The pod's gang, if any: a scheduler-plugins, Volcano or KAI pod group, a Kueue pod group or admitted
    workload, or ours. ``min_members`` maps ``namespace/name`` of PodGroups and Kueue Workloads to their minimum
    (from watches); the ``cachefs.io/gang-size`` and Kueue's ``pod-group-total-count`` annotations work without."""
    meta = _meta(pod)
    raw_labels, raw_ann = meta.get("labels"), meta.get("annotations")
    labels: Mapping[str, Any] = raw_labels if isinstance(raw_labels, Mapping) else {}
    ann: Mapping[str, Any] = raw_ann if isinstance(raw_ann, Mapping) else {}
    namespace = str(meta.get("namespace") or "default")
    name = (labels.get(COSCHEDULING_LABEL) or ann.get(VOLCANO_ANNOTATION) or ann.get(KAI_ANNOTATION)
            or labels.get(KUEUE_GROUP_LABEL) or ann.get(KUEUE_WORKLOAD_ANNOTATION) or ann.get(GANG_ANNOTATION))
    if not name or not isinstance(name, str):
        return None
    size = _quantity(ann.get(GANG_SIZE_ANNOTATION) or ann.get(KUEUE_GROUP_COUNT_ANNOTATION) or 0)
    if not size and min_members:
        size = min_members.get(f"{namespace}/{name}", 0)
    return GangRef(namespace, name, max(1, size), topology_assigned=KUEUE_TAS_LABEL in labels)

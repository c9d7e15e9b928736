"""What a cachefs volume is: a dataset URL plus origin options, named by a volume id that carries them.

Volume attributes (a PV's ``volumeAttributes``, an inline volume's ``volumeAttributes``, or a StorageClass's
``parameters`` through CreateVolume):

============== =====================================================================
``url``        dataset URL (this or ``dataset``): ``s3://bucket/prefix``, ``gs://…``, ``file:///…``
``dataset``    instead of ``url``: the name of a CacheDataset in the pod's namespace, whose URL,
               endpoint, region and credentials Secret the volume uses (docs/DATASETS.md)
``endpointUrl`` S3 endpoint (MinIO, Ceph, a local server); default: the node's AWS settings
``region``     S3 region
``mode``       read bits of the files (``0444``, ``0440``, ``0400``): default ``0440``
               (owner root, group the pod's ``fsGroup``) when the pod has an fsGroup,
               else ``0444`` (a pod's processes may run as any user). ``0444`` widens a
               group's volume to every user in the pod on purpose.
``sampler``    the readers' sampler (``torch-distributed:seed=0,world-size=8,ranks=0-7,…``,
               docs/SEMANTICS.md "Epochs"): the volume's mount publishes each epoch's read
               order itself, so a job that uses the sampler needs no cachefs code
``writable``   ``"true"``: a checkpoint volume (S3 only; docs/SEMANTICS.md "Checkpoints"):
               files written there are durable on the node at close and fsync and reach
               the origin in the background, in close order; ReadWriteOnce and
               ReadWriteMany are accepted (each node uploads what its pods wrote)
============== =====================================================================

Who reads: the pod's ``fsGroup`` reaches NodePublishVolume as the mount group (``VOLUME_MOUNT_GROUP``; the
CSIDriver says ``fsGroupPolicy: File``), and a volume published for one group gets its own FUSE session whose
files belong to that group (:attr:`DatasetVolume.group`, part of the session key, not of the volume id).

Credentials come from the secret kubelet passes (``awsAccessKeyID`` / ``awsSecretAccessKey`` /
``awsSessionToken``, or the same names as the AWS environment variables) and are never logged.

Volume ids are ``cfs1.<base64url of the attributes>``, and CreateVolume adds ``.<hash of the volume name>`` so
that two claims of one dataset get two volumes: stateless (DeleteVolume has nothing to delete, no data is
copied) yet checkable (an id we did not make is NOT_FOUND).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass

from cachefs.base.errors import ConfigError
from cachefs.base.values import parse_read_mode
from cachefs.prefetch.samplers import parse_sampler

__all__ = ["ATTRIBUTES", "KUBE_ADDED", "DatasetVolume", "VolumeError", "credentials_env"]

ATTRIBUTES = ("url", "dataset", "endpointUrl", "region", "mode", "sampler", "writable")
#: A CacheDataset's name: a DNS subdomain (RFC 1123), as Kubernetes names objects.
_DATASET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_ID_PREFIX = "cfs1."
_SECRET_KEYS = {
    "awsAccessKeyID": "AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "awsSecretAccessKey": "AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
    "awsSessionToken": "AWS_SESSION_TOKEN", "AWS_SESSION_TOKEN": "AWS_SESSION_TOKEN",
}


class VolumeError(ValueError):
    """Bad volume attributes or id (the driver answers INVALID_ARGUMENT or NOT_FOUND)."""


@dataclass(frozen=True)
class DatasetVolume:
    url: str
    endpoint_url: str = ""
    region: str = ""
    mode: str = ""  # the ``mode`` attribute as given ("" = the default for the pod's group)
    sampler: str = ""  # the ``sampler`` attribute as given ("" = none declared)
    writable: bool = False  # a checkpoint volume (the ``writable`` attribute)
    #: A CacheDataset named in place of the URL (``url`` is empty until NodePublishVolume reads the object).
    dataset: str = ""
    #: The group (a pod's fsGroup) this volume is published for: who reads it, not what it is, so it is kept
    #: out of the attributes and the volume id.
    group: int | None = None

    @classmethod
    def from_attributes(cls, attrs: dict[str, str]) -> DatasetVolume:
        unknown = sorted(set(attrs) - set(ATTRIBUTES) - KUBE_ADDED)
        if unknown:
            raise VolumeError(f"unknown volume attribute(s) {', '.join(unknown)}; known: {', '.join(ATTRIBUTES)}")
        url, dataset = attrs.get("url", "").strip(), attrs.get("dataset", "").strip()
        if dataset:
            return cls._naming_a_dataset(attrs, dataset, url)
        if not url:
            raise VolumeError("volume attribute 'url' (the dataset URL, e.g. s3://bucket/prefix) or 'dataset' (a "
                              "CacheDataset's name) is required")
        if "://" not in url:
            raise VolumeError(f"url {url!r} is not a URL (want e.g. s3://bucket/prefix or file:///data)")
        scheme = url.split("://", 1)[0]
        if not _known_scheme(scheme):
            raise VolumeError(f"url {url!r}: no storage is known for the scheme {scheme!r} (e.g. s3, gs, file)")
        mode = attrs.get("mode", "").strip()
        if mode:
            try:
                parse_read_mode(mode, "volume attribute 'mode'")
            except ConfigError as exc:
                raise VolumeError(str(exc)) from None
        sampler = attrs.get("sampler", "").strip()
        if sampler:
            try:
                parse_sampler(sampler)
            except ConfigError as exc:
                raise VolumeError(f"volume attribute 'sampler': {exc}") from None
        writable = attrs.get("writable", "false").strip().lower()
        if writable not in ("true", "false"):
            raise VolumeError(f"volume attribute 'writable' is {writable[:32]!r}: \"true\" or \"false\"")
        if writable == "true":
            if scheme not in ("s3", "s3a"):
                raise VolumeError(f"url {url!r}: writable volumes are on S3 (s3://bucket/prefix)")
            if sampler or mode:
                raise VolumeError("'sampler' and 'mode' are for read-only datasets, not writable volumes")
        return cls(url, attrs.get("endpointUrl", "").strip(), attrs.get("region", "").strip(), mode, sampler,
                   writable == "true")

    @classmethod
    def _naming_a_dataset(cls, attrs: dict[str, str], dataset: str, url: str) -> DatasetVolume:
        if url or attrs.get("endpointUrl") or attrs.get("region"):
            raise VolumeError("volume attribute 'dataset' names a CacheDataset, which says the URL, endpoint and "
                              "region: give either 'dataset' or 'url', not both")
        if "/" in dataset:
            raise VolumeError(f"volume attribute 'dataset' is {dataset[:64]!r}: a CacheDataset is named without a "
                              "namespace (it is looked up in the pod's own namespace)")
        if len(dataset) > 253 or not _DATASET_NAME.fullmatch(dataset):
            raise VolumeError(f"volume attribute 'dataset' is {dataset[:64]!r}: not a Kubernetes object name")
        if attrs.get("writable", "false").strip().lower() != "false":
            raise VolumeError("a CacheDataset is read-only: writable volumes name their S3 prefix with 'url'")
        probe = cls.from_attributes({**{k: v for k, v in attrs.items() if k != "dataset"}, "url": "file:///"})
        return dataclasses.replace(probe, url="", dataset=dataset)  # (mode and sampler checked as for a URL)

    def resolved(self, url: str, endpoint_url: str, region: str) -> DatasetVolume:
        """This volume with the URL, endpoint and region its CacheDataset says (checked as a ``url`` volume)."""
        attrs = {k: v for k, v in {"url": url, "endpointUrl": endpoint_url, "region": region, "mode": self.mode,
                                   "sampler": self.sampler}.items() if v}
        return dataclasses.replace(DatasetVolume.from_attributes(attrs), group=self.group)

    def for_group(self, group: int | None) -> DatasetVolume:
        """This volume as published for a pod whose fsGroup is ``group`` (None: no fsGroup)."""
        return dataclasses.replace(self, group=group)

    @property
    def file_mode(self) -> int:
        """The read bits its files get: the ``mode`` attribute, else 0440 for a group and 0444 without."""
        if self.mode:
            return parse_read_mode(self.mode)
        return 0o440 if self.group is not None else 0o444

    def attributes(self) -> dict[str, str]:
        out = {"dataset": self.dataset} if self.dataset else {"url": self.url}
        if self.endpoint_url:
            out["endpointUrl"] = self.endpoint_url
        if self.region:
            out["region"] = self.region
        if self.mode:
            out["mode"] = self.mode
        if self.sampler:
            out["sampler"] = self.sampler
        if self.writable:
            out["writable"] = "true"
        return out

    @property
    def volume_id(self) -> str:
        raw = json.dumps(self.attributes(), sort_keys=True, separators=(",", ":")).encode()
        return _ID_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def volume_id_for(self, name: str) -> str:
        """The id of the volume CreateVolume makes for a claim ``name`` of this dataset."""
        return f"{self.volume_id}.{hashlib.blake2b(name.encode(), digest_size=6).hexdigest()}"

    @classmethod
    def from_volume_id(cls, volume_id: str) -> DatasetVolume:
        """The volume an id names (with or without the name suffix)."""
        if not volume_id.startswith(_ID_PREFIX):
            raise VolumeError(f"volume {volume_id!r} is not a cachefs volume")
        body = volume_id[len(_ID_PREFIX):].split(".", 1)[0]  # base64url has no "."
        try:
            attrs = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            return cls.from_attributes(attrs)
        except (ValueError, TypeError, AttributeError) as exc:
            raise VolumeError(f"volume {volume_id!r} is not a cachefs volume") from exc

    @property
    def session_key(self) -> str:
        """Volumes with the same key share one FUSE session on a node (all sessions share the node's cache): the
        same dataset, origin options and readers."""
        key = hashlib.blake2b(json.dumps(self.attributes(), sort_keys=True).encode(), digest_size=10).hexdigest()
        return key if self.group is None else f"{key}-g{self.group}"


#: Attributes Kubernetes adds on its own (podInfoOnMount, ephemeral volumes, external-provisioner).
KUBE_ADDED = {
    "csi.storage.k8s.io/pod.name", "csi.storage.k8s.io/pod.namespace", "csi.storage.k8s.io/pod.uid",
    "csi.storage.k8s.io/serviceAccount.name", "csi.storage.k8s.io/ephemeral",
    "storage.kubernetes.io/csiProvisionerIdentity",
}


def _known_scheme(scheme: str) -> bool:
    import fsspec

    return scheme in fsspec.available_protocols()


def credentials_env(secrets: dict[str, str]) -> dict[str, str]:
    """The origin credentials in a secret as AWS environment variables (unknown keys are ignored)."""
    return {_SECRET_KEYS[k]: v for k, v in secrets.items() if k in _SECRET_KEYS}

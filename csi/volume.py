"""What a cachefs volume is: a dataset URL plus origin options, named by a volume id that carries them.

Volume attributes (a PV's ``volumeAttributes``, an inline volume's ``volumeAttributes``, or a StorageClass's
``parameters`` through CreateVolume):

============== =====================================================================
``url``        dataset URL (required): ``s3://bucket/prefix``, ``gs://…``, ``file:///…``
``endpointUrl`` S3 endpoint (MinIO, Ceph, a local server); default: the node's AWS settings
``region``     S3 region
============== =====================================================================

Credentials come from the secret kubelet passes (``awsAccessKeyID`` / ``awsSecretAccessKey`` /
``awsSessionToken``, or the same names as the AWS environment variables) and are never logged.

Volume ids are ``cfs1.<base64url of the attributes>``, and CreateVolume adds ``.<hash of the volume name>`` so
that two claims of one dataset get two volumes: stateless (DeleteVolume has nothing to delete, no data is
copied) yet checkable (an id we did not make is NOT_FOUND).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass

__all__ = ["ATTRIBUTES", "KUBE_ADDED", "DatasetVolume", "VolumeError", "credentials_env"]

ATTRIBUTES = ("url", "endpointUrl", "region")
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

    @classmethod
    def from_attributes(cls, attrs: dict[str, str]) -> DatasetVolume:
        unknown = sorted(set(attrs) - set(ATTRIBUTES) - KUBE_ADDED)
        if unknown:
            raise VolumeError(f"unknown volume attribute(s) {', '.join(unknown)}; known: {', '.join(ATTRIBUTES)}")
        url = attrs.get("url", "").strip()
        if not url:
            raise VolumeError("volume attribute 'url' (the dataset URL, e.g. s3://bucket/prefix) is required")
        if "://" not in url:
            raise VolumeError(f"url {url!r} is not a URL (want e.g. s3://bucket/prefix or file:///data)")
        scheme = url.split("://", 1)[0]
        if not _known_scheme(scheme):
            raise VolumeError(f"url {url!r}: no storage is known for the scheme {scheme!r} (e.g. s3, gs, file)")
        return cls(url, attrs.get("endpointUrl", "").strip(), attrs.get("region", "").strip())

    def attributes(self) -> dict[str, str]:
        out = {"url": self.url}
        if self.endpoint_url:
            out["endpointUrl"] = self.endpoint_url
        if self.region:
            out["region"] = self.region
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
        """Volumes with the same key share one FUSE session (and cache) on a node."""
        return hashlib.blake2b(json.dumps(self.attributes(), sort_keys=True).encode(), digest_size=10).hexdigest()


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

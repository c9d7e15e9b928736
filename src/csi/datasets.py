"""Volumes that name a CacheDataset (the ``dataset`` volume attribute, in a StorageClass's parameters, a PV's or an
inline volume's attributes): at NodePublishVolume the plugin reads the object and mounts its URL, endpoint and region
with its credentials Secret (docs/DATASETS.md).

Only the pod's own namespace is looked in (kubelet passes it: the CSIDriver's ``podInfoOnMount``), so a pod can name
no dataset, and so borrow no credentials, outside it. The Secret is read with the node's service account, which may
read it only where the namespace's Role grants that Secret to it (the grant warm-ups need too); credentials kubelet
passes (``nodePublishSecretRef``) take its place.
"""

from __future__ import annotations

import asyncio

import grpc

from cachefs.base.errors import ConfigError
from cachefs.cluster.cachedatasets import API, secret_credentials
from cachefs.kube import ApiError, KubeClient
from csi.api import ApiAccess
from csi.volume import DatasetVolume, VolumeError, credentials_env

__all__ = ["POD_NAMESPACE", "DatasetLookupError", "DatasetResolver"]

POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"


class DatasetLookupError(Exception):
    """A volume's CacheDataset cannot be used; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DatasetResolver:
    """Reads CacheDatasets and their Secrets from the API server (in-cluster, or ``kubeconfig``)."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        self.api = ApiAccess(kubeconfig)

    def resolve(self, vol: DatasetVolume, context: dict[str, str], secrets: dict[str, str]
                ) -> tuple[DatasetVolume, dict[str, str]]:
        """``vol`` with its CacheDataset's URL, endpoint and region, and the origin credentials to mount it with."""
        namespace = context.get(POD_NAMESPACE, "")
        if not namespace:
            raise DatasetLookupError(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"volume names CacheDataset {vol.dataset!r} but kubelet passed no pod namespace "
                                     "(the CSIDriver needs podInfoOnMount: true)")
        return asyncio.run(self._resolve(vol, namespace, secrets))

    async def _resolve(self, vol: DatasetVolume, namespace: str, secrets: dict[str, str]
                       ) -> tuple[DatasetVolume, dict[str, str]]:
        where = f"CacheDataset {namespace}/{vol.dataset}"
        try:
            async with self.api.client() as client:
                return await self._read(client, vol, namespace, secrets, where)
        except ConfigError as exc:
            raise DatasetLookupError(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {exc}") from None

    async def _read(self, client: KubeClient, vol: DatasetVolume, namespace: str, secrets: dict[str, str],
                    where: str) -> tuple[DatasetVolume, dict[str, str]]:
        obj = await _get(client, f"{API}/namespaces/{namespace}/cachedatasets/{vol.dataset}", where)
        spec = obj.get("spec") or {}
        try:
            resolved = vol.resolved(str(spec.get("url") or ""), str(spec.get("endpointUrl") or ""),
                                    str(spec.get("region") or ""))
        except VolumeError as exc:
            raise DatasetLookupError(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {exc}") from None
        env = credentials_env(secrets)
        name = spec.get("credentialsSecret")
        if not env and name:
            secret = await _get(client, f"/api/v1/namespaces/{namespace}/secrets/{name}",
                                f"Secret {namespace}/{name} (the credentials of {where})")
            try:
                env = secret_credentials(secret)
            except ValueError as exc:
                raise DatasetLookupError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return resolved, env


async def _get(client: KubeClient, path: str, what: str) -> dict:
    try:
        return await client.get(path)
    except ApiError as exc:
        if exc.status == 404:
            raise DatasetLookupError(grpc.StatusCode.NOT_FOUND, f"{what} not found") from None
        if exc.status in (401, 403):
            raise DatasetLookupError(grpc.StatusCode.PERMISSION_DENIED,
                                     f"{what}: the node's service account may not read it ({exc.reason})") from None
        raise DatasetLookupError(grpc.StatusCode.UNAVAILABLE, f"{what}: {exc}") from None
    except OSError as exc:  # (aiohttp's connection errors are OSErrors)
        raise DatasetLookupError(grpc.StatusCode.UNAVAILABLE, f"{what}: API server unreachable: {exc}") from None

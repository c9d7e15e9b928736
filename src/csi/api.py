"""The node plugin's access to the Kubernetes API (in-cluster, or ``--kubeconfig``), for the few calls it makes
from its gRPC and background threads: a client per call, the configuration loaded once."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from cachefs.kube import KubeClient, KubeConfig, load_kube_config

__all__ = ["ApiAccess"]


class ApiAccess:
    def __init__(self, kubeconfig: str | None = None) -> None:
        self._kubeconfig = kubeconfig
        self._config: KubeConfig | None = None

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[KubeClient]:
        """A client, closed after use; raises ConfigError when there is no API access."""
        if self._config is None:
            self._config = load_kube_config(self._kubeconfig)
        client = KubeClient(self._config, timeout=10.0)
        try:
            yield client
        finally:
            await client.aclose()

"""Watch-fed caches for the extender: nodes, PVs/PVCs, pods, PodGroups and Kueue Workloads, and DRA's
ResourceSlices, ResourceClaims, their templates and DeviceClasses, each kept current by list + watch
(never an API call per scheduling request).

:class:`~cachefs.kube.Reflector` is the one list/watch loop (the cache group's membership uses it too);
:class:`ClusterWatch` runs one reflector per resource and feeds the :class:`~scheduler_hints.extender.Extender`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from cachefs.cluster.cachedatasets import API as CACHEDATASETS_API
from cachefs.cluster.cachedatasets import WARM_FOR
from cachefs.kube import ApiError, KubeClient, Reflector
from scheduler_hints.dra import DraInventory
from scheduler_hints.extender import Binder, Extender
from scheduler_hints.pods import (
    CSI_DRIVER,
    URL_ATTRIBUTES,
    WARM_READY_ANNOTATION,
    VolumeIndex,
    pod_gpus,
    pod_key,
    volume_dataset,
)

__all__ = ["ClusterWatch", "KubeBinder", "Reflector", "WatchedVolumes"]

log = logging.getLogger(__name__)

class WatchedVolumes(VolumeIndex):
    """PVC → dataset URL from watched PVCs and PVs of the cachefs CSI driver, and CacheDataset → URL for volumes
    that name one."""

    def __init__(self) -> None:
        self.pv_attrs: dict[str, dict[str, str]] = {}  # a cachefs PV's dataset attributes
        self.claim_pv: dict[tuple[str, str], str] = {}
        self.datasets: dict[tuple[str, str], str] = {}  # (namespace, name) → URL

    def claim_dataset(self, namespace: str, claim: str) -> str | None:
        pv = self.claim_pv.get((namespace, claim))
        return volume_dataset(self.pv_attrs.get(pv), namespace, self) if pv else None

    def dataset_url(self, namespace: str, name: str) -> str | None:
        return self.datasets.get((namespace, name))

    def on_pv(self, kind: str, pv: Mapping[str, Any]) -> None:
        name = (pv.get("metadata") or {}).get("name")
        if not name:
            return
        csi = (pv.get("spec") or {}).get("csi") or {}
        attrs = csi.get("volumeAttributes") or {}
        named = {k: str(attrs[k]) for k in URL_ATTRIBUTES if isinstance(attrs, Mapping) and attrs.get(k)}
        if kind == "DELETED" or csi.get("driver") != CSI_DRIVER or not named:
            self.pv_attrs.pop(name, None)
        else:
            self.pv_attrs[name] = named

    def on_dataset(self, kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        url = (obj.get("spec") or {}).get("url")
        if kind == "DELETED" or not url:
            self.datasets.pop(key, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.datasets[key] = str(url)

    def on_pvc(self, kind: str, pvc: Mapping[str, Any]) -> None:
        meta = pvc.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        volume = (pvc.get("spec") or {}).get("volumeName")
        if kind == "DELETED" or not volume:
            self.claim_pv.pop(key, None)
        else:
            self.claim_pv[key] = str(volume)


class KubeBinder(Binder):
    """Binds by creating the pod's ``binding`` subresource, as kube-scheduler itself does."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        meta: dict[str, str] = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        await self.client.post(f"/api/v1/namespaces/{namespace}/pods/{name}/binding", {
            "apiVersion": "v1", "kind": "Binding", "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}})


class ClusterWatch:
    """Runs the reflectors that keep an :class:`Extender`'s view of the cluster current."""

    #: Gang sizes: PodGroups of scheduler-plugins, Volcano and KAI (``spec.minMember``), and Kueue's Workloads
    #: (the pods of their pod sets). Each is optional: a cluster without that API skips it.
    PODGROUPS = ("/apis/scheduling.x-k8s.io/v1alpha1/podgroups", "/apis/scheduling.volcano.sh/v1beta1/podgroups",
                 "/apis/scheduling.run.ai/v2alpha2/podgroups")
    WORKLOADS = ("/apis/kueue.x-k8s.io/v1beta1/workloads", "/apis/kueue.x-k8s.io/v1beta2/workloads")
    #: Dynamic Resource Allocation (GA in Kubernetes 1.34): skipped where the API is not served.
    DRA = "/apis/resource.k8s.io/v1"

    def __init__(self, client: KubeClient, ext: Extender) -> None:
        self.client, self.ext = client, ext
        self.volumes = WatchedVolumes()
        ext.state.volumes = self.volumes
        dra = ext.dra if ext.dra is not None else ext.state.use_dra(DraInventory())
        self.reflectors = [
            Reflector(client, "/api/v1/nodes", self._on_node),
            Reflector(client, "/api/v1/persistentvolumes", self.volumes.on_pv),
            Reflector(client, "/api/v1/persistentvolumeclaims", self.volumes.on_pvc),
            Reflector(client, f"{CACHEDATASETS_API}/cachedatasets", self.volumes.on_dataset, optional=True),
            Reflector(client, "/api/v1/pods", self._on_pod),
            *(Reflector(client, path, self._on_podgroup, optional=True) for path in self.PODGROUPS),
            *(Reflector(client, path, self._on_workload, optional=True) for path in self.WORKLOADS),
            Reflector(client, f"{self.DRA}/deviceclasses", dra.on_class, optional=True),
            Reflector(client, f"{self.DRA}/resourceclaimtemplates", dra.on_template, optional=True),
            Reflector(client, f"{self.DRA}/resourceclaims", self._on_claim, optional=True),
            Reflector(client, f"{self.DRA}/resourceslices", self._on_slice, optional=True),
        ]
        self._tasks: list[asyncio.Task] = []
        self._touching: asyncio.Task | None = None
        self._prewarm_written: dict[str, str] | None = None  # the ConfigMap's data as last written or read

    #: Node changes come in bursts (every agent publishes about once a second during a warm-up): the pods waiting
    #: for warm data are asked again this long after the first change of a burst, or once the extender's cluster
    #: view follows it (``NodeCache.refresh_interval``), whichever is later: the filter asks that view too.
    TOUCH_DELAY = 0.5

    def _on_slice(self, kind: str, obj: Mapping[str, Any]) -> None:
        assert self.ext.dra is not None
        self.ext.dra.on_slice(kind, obj)
        self.ext.node_cache.dra_changed()

    def _on_claim(self, kind: str, obj: Mapping[str, Any]) -> None:
        assert self.ext.dra is not None
        self.ext.dra.on_claim(kind, obj)

    def _on_node(self, kind: str, node: Mapping[str, Any]) -> None:
        if kind == "DELETED":
            name = str((node.get("metadata") or {}).get("name", ""))
            self.ext.node_cache.remove(name)
        elif kind in ("ADDED", "MODIFIED"):
            self.ext.node_cache.update(node)
            if self.ext.warm_waiting and self._touching is None:
                self._touching = asyncio.get_running_loop().create_task(self._touch_warm())

    async def _touch_warm(self) -> None:
        """Pods that waited for warm data and may run now get :data:`WARM_READY_ANNOTATION`: kube-scheduler tries
        a refused pod again on the next event, and one that came before this watch saw the node's new labels was
        refused again and would wait for the change after (or kube-scheduler's five-minute flush)."""
        try:
            await asyncio.sleep(max(self.TOUCH_DELAY, self.ext.node_cache.refresh_interval))
            for pod in self.ext.warm_now():
                meta = pod.get("metadata") or {}
                path = f"/api/v1/namespaces/{meta.get('namespace', 'default')}/pods/{meta.get('name', '')}"
                stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                try:
                    await self.client.merge_patch(path, {"metadata": {"annotations": {WARM_READY_ANNOTATION: stamp}}})
                except (TimeoutError, ApiError, OSError) as exc:  # (deleted meanwhile; or no right to patch)
                    log.info("could not mark %s warm: %s", path, exc)
        finally:
            self._touching = None

    def _on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        key = pod_key(pod)
        if self.ext.dra is not None:
            self.ext.dra.on_pod(kind, pod, key)
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if kind == "DELETED" or phase in ("Succeeded", "Failed"):
            self.ext.pod_gone(key)
        elif node:
            self.ext.bound_pods[key] = (str(node), pod_gpus(pod))
            self.ext.pending_pods.pop(key, None)
        elif phase in (None, "Pending") and (gpus := self.ext.gpus_of(pod)) > 0:
            self.ext.pod_pending(key, gpus)

    def _on_podgroup(self, kind: str, pg: Mapping[str, Any]) -> None:
        meta = pg.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        if kind == "DELETED":
            self.ext.min_members.pop(key, None)
        elif kind in ("ADDED", "MODIFIED"):
            try:
                self.ext.min_members[key] = int((pg.get("spec") or {}).get("minMember") or 1)
            except (TypeError, ValueError):
                pass

    def _on_workload(self, kind: str, wl: Mapping[str, Any]) -> None:
        """A Kueue Workload: its gang is every pod of its pod sets (``minCount`` where partial admission set it)."""
        meta = wl.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        if kind == "DELETED":
            self.ext.min_members.pop(key, None)
            return
        if kind not in ("ADDED", "MODIFIED"):
            return
        total = 0
        for podset in (wl.get("spec") or {}).get("podSets") or ():
            try:
                total += int(podset.get("minCount") or podset.get("count") or 0)
            except (AttributeError, TypeError, ValueError):
                continue
        if total > 0:
            self.ext.min_members[key] = total

    #: Seconds between writes of the pending gangs' warm-ups (:data:`~cachefs.cluster.cachedatasets.WARM_FOR`).
    PREWARM_EVERY = 5.0

    async def _prewarm_loop(self) -> None:
        while True:
            await asyncio.sleep(self.PREWARM_EVERY)
            try:
                await self.write_prewarm()
            except (TimeoutError, ApiError, OSError) as exc:  # (the next pass tries again)
                log.info("could not write the warm-ups for pending gangs: %s", exc)

    async def write_prewarm(self) -> bool:
        """Write what :class:`~scheduler_hints.prewarm.PreWarm` wants each cache group to warm into the ConfigMap
        the node agents read, if it changed; whether it wrote."""
        wanted = {g: json.dumps(urls) for g, urls in self.ext.prewarm.wanted().items()}
        if self._prewarm_written is None:  # (after a restart: what an earlier extender wrote)
            try:
                self._prewarm_written = dict((await self.client.get(WARM_FOR)).get("data") or {})
            except ApiError as exc:
                if exc.status != 404:
                    raise
                self._prewarm_written = {}
        if wanted == self._prewarm_written:
            return False
        data: dict[str, str | None] = {**{g: None for g in self._prewarm_written if g not in wanted}, **wanted}
        try:
            await self.client.merge_patch(WARM_FOR, {"data": data})
        except ApiError as exc:
            if exc.status != 404:
                raise
            await self.client.post(WARM_FOR.rsplit("/", 1)[0], {
                "apiVersion": "v1", "kind": "ConfigMap", "data": wanted,
                "metadata": {"name": WARM_FOR.rsplit("/", 1)[1], "namespace": "cachefs-system"}})
        self._prewarm_written = wanted
        return True

    async def start(self, timeout: float = 60.0) -> None:
        """Start every reflector and wait until each has listed once."""
        self._tasks = [asyncio.create_task(r.run()) for r in self.reflectors]
        await asyncio.wait_for(asyncio.gather(*(r.synced.wait() for r in self.reflectors)), timeout)
        self._tasks.append(asyncio.create_task(self._prewarm_loop()))

    async def aclose(self) -> None:
        if self._touching is not None:
            self._tasks.append(self._touching)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

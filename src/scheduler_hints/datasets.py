"""CacheDataset status (docs/DATASETS.md): what the cluster's caches hold of each dataset, in the object users look at.

The figures are the node agents' own accounting, as each agent publishes it on its Node (the ``ds.cachefs.io/<id>``
annotation, docs/LABELS.md: bytes its index records as present, never bytes merely asked for), added up here:

* ``files`` / ``totalBytes``: the dataset at the origin, as the newest manifest any node holds says;
* ``nodes``: per node its cached bytes (guest copies included: they are on that node's disk);
* ``groups``: per cache group its own bytes (guest copies left out: a group keeps each byte once), and the
  group's cached percentage;
* ``cachedBytes`` / ``cachedPercentage``: those of the dataset's placement — its cache group, the nodes its
  ``nodeSelector`` matches, or else the best single group or node (what one pod could read without the origin);
* ``phase``: ``Pending`` (no node holds any of it yet), ``Listing`` (a node's warm-up is listing the origin, and
  no node holds a manifest of it yet: ``listedFiles`` says how many files so far), ``Warming`` (a warm-up is on and
  not done), ``Ready``
  (placed whole), ``Partial`` (no warm-up, partly cached), ``Failed`` (a node's warm-up failed: ``reason`` says
  which and why);
* ``warmup``: the warm-up's progress N of M files and bytes, and errors, added up from what each node running it
  publishes (``warm.cachefs.io/<id>``, :mod:`cachefs.jobs.warmups`), and per node;
* ``rate`` / ``eta``: how fast the placement's bytes grew since the last status, and when at that rate it is whole.

:func:`dataset_status` is pure; :class:`DatasetController` lists the objects and the Nodes every few seconds and
writes a status only when it changed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cachefs.base.types import dataset_id
from cachefs.base.values import human_bytes
from cachefs.cluster.cachedatasets import API, placed_on, warm_key
from cachefs.kube import ApiError
from scheduler_hints.labels import GROUP_LABEL, DatasetCache, dataset_key, read_dataset_annotation, rfc3339

__all__ = ["API", "DatasetController", "dataset_status"]

log = logging.getLogger(__name__)

#: Seconds between passes over the objects.
INTERVAL = 5.0


@dataclass(frozen=True)
class _Holding:
    node: str
    group: str
    figures: DatasetCache


def _holdings(ds_id: str, nodes: list[Mapping[str, Any]]) -> list[_Holding]:
    """What each node published of the dataset (malformed figures: as if nothing were cached there)."""
    out = []
    key = dataset_key(ds_id)
    for node in nodes:
        meta = node.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(key)
        figures = read_dataset_annotation(ds_id, raw) if raw else None
        if figures is not None:
            out.append(_Holding(str(meta.get("name", "")), str((meta.get("labels") or {}).get(GROUP_LABEL, "")),
                                figures))
    return out


def _percent(part: int, whole: int) -> float:
    return round(min(100.0, 100.0 * part / whole), 1) if whole > 0 else 0.0


def dataset_status(obj: Mapping[str, Any], nodes: list[Mapping[str, Any]], now: float) -> dict[str, Any]:
    """The status of CacheDataset ``obj`` given every Node (``now``: seconds since the epoch)."""
    spec = obj.get("spec") or {}
    previous = obj.get("status") or {}
    url = str(spec.get("url", ""))
    try:
        ds_id = dataset_id(url)
    except (ValueError, TypeError) as exc:
        return {"phase": "Failed", "reason": f"spec.url: {exc}", "observedGeneration": _generation(obj)}
    holdings = _holdings(ds_id, nodes)
    newest = max(holdings, key=lambda h: (h.figures.manifest_version, h.figures.total_bytes), default=None)
    total = newest.figures.total_bytes if newest else 0
    placed = {str((n.get("metadata") or {}).get("name", "")) for n in nodes if placed_on(spec, n)}
    placed_by_spec = bool(spec.get("cacheGroup") or spec.get("nodeSelector"))
    groups: dict[str, int] = {}
    for h in holdings:
        if h.group:
            groups[h.group] = groups.get(h.group, 0) + max(0, h.figures.cached_bytes - h.figures.guest_bytes)
    if placed_by_spec:
        mine = [h for h in holdings if h.node in placed]
        own = sum(max(0, h.figures.cached_bytes - h.figures.guest_bytes) for h in mine)
        cached = own if any(h.group for h in mine) else max((h.figures.cached_bytes for h in mine), default=0)
    else:  # the best any one pod could read without the origin: its group's bytes, or a lone node's
        cached = max([*groups.values(), *(h.figures.cached_bytes for h in holdings if not h.group)], default=0)
    cached = min(cached, total) if total else cached
    warmup = bool((spec.get("warmup") or {}).get("enabled"))
    warming = _warmups(ds_id, nodes) if warmup else {}
    failed = [f"{w['node']}: {w.get('reason') or 'failed'}" for w in warming.get("nodes", ())
              if w.get("state") == "failed"]
    if total and cached >= total:
        phase = "Ready"
    elif failed:
        phase = "Failed"
    elif not holdings and any(w.get("state") == "listing" for w in warming.get("nodes", ())):
        phase = "Listing"
    elif not holdings:
        phase = "Pending"
    elif warmup:
        phase = "Warming"
    else:
        phase = "Partial"
    status: dict[str, Any] = {
        "phase": phase,
        "datasetID": ds_id,
        "files": newest.figures.total_files if newest else 0,
        "totalBytes": total,
        "size": human_bytes(total) if total else "",
        "cachedBytes": cached,
        "cachedPercentage": f"{_percent(cached, total):.1f}%" if total else "",
        "nodes": [{"name": h.node, "group": h.group, "cachedBytes": h.figures.cached_bytes, "guestBytes": h.figures.guest_bytes}
                  for h in sorted(holdings, key=lambda h: h.node)],
        "groups": [{"name": g, "cachedBytes": b, "cachedPercentage": f"{_percent(b, total):.1f}%"}
                   for g, b in sorted(groups.items())],
        "observedGeneration": _generation(obj),
    }
    if warming:
        status["warmup"] = warming
    if phase == "Listing":
        status["listedFiles"] = max(w.get("filesListed", 0) for w in warming["nodes"])
    if failed:
        status["reason"] = "; ".join(failed)[:1000]
    status.update(_progress(previous, cached, total, now))
    if _figures(previous) == _figures(status):
        status["lastChange"] = previous.get("lastChange", rfc3339(now))
    else:
        status["lastChange"] = rfc3339(now)
    status["conditions"] = [{"type": "Ready", "status": "True" if phase == "Ready" else "False", "reason": phase,
                             "lastTransitionTime": _transition(previous, phase, now)}]
    return status


def _warmups(ds_id: str, nodes: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The warm-up's progress as the nodes running it publish it (``warm.cachefs.io/<id>``), added up."""
    per_node: list[dict[str, Any]] = []
    for node in nodes:
        meta = node.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(warm_key(ds_id))
        try:
            w = json.loads(raw) if raw else None
            if not isinstance(w, dict):
                continue
            per_node.append({"node": str(meta.get("name", "")), "state": str(w.get("state", "")),
                             **{k: max(0, int(w.get(k, 0))) for k in ("filesDone", "filesTotal", "bytesDone",
                                                                       "bytesTotal", "errors", "filesListed")},
                             "reason": str(w.get("reason", ""))[:300]})
        except (ValueError, TypeError):
            continue
    if not per_node:
        return {}
    states = {w["state"] for w in per_node}
    sums = {k: sum(w[k] for w in per_node) for k in ("filesDone", "filesTotal", "bytesDone", "bytesTotal", "errors")}
    state = ("running" if "running" in states else "listing" if "listing" in states else
             "failed" if "failed" in states else "done")
    return {"state": state, **sums, "progress": f"{sums['filesDone']}/{sums['filesTotal']} files",
            "nodes": sorted(per_node, key=lambda w: w["node"])}


def _generation(obj: Mapping[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("generation") or 0)



def _figures(status: Mapping[str, Any]) -> dict[str, Any]:
    """What a status says, less the times and rates that come with any pass."""
    return {k: v for k, v in status.items() if k not in ("rate", "eta", "lastChange", "conditions", "sampledAt",
                                                          "sampledBytes")}


def _progress(previous: Mapping[str, Any], cached: int, total: int, now: float) -> dict[str, Any]:
    """Rate (bytes/s) since the last sample, and the ETA at that rate; a sample is kept about every 30 s so that
    the rate is not the noise of one pass."""
    prev_at, prev_bytes = float(previous.get("sampledAt") or 0), int(previous.get("sampledBytes") or 0)
    rate = float(previous.get("rateBytesPerSecond") or 0)
    out: dict[str, Any] = {"sampledAt": prev_at, "sampledBytes": prev_bytes}
    if not prev_at or now - prev_at >= 30 or cached < prev_bytes:
        if prev_at and now > prev_at:
            rate = max(0.0, (cached - prev_bytes) / (now - prev_at))
        out = {"sampledAt": round(now, 3), "sampledBytes": cached}
    out["rateBytesPerSecond"] = round(rate)
    out["rate"] = f"{human_bytes(rate)}/s" if rate else ""
    out["eta"] = f"{(total - cached) / rate:.0f}s" if rate > 0 and total > cached else ""
    return out


def _transition(previous: Mapping[str, Any], phase: str, now: float) -> str:
    for c in previous.get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("reason") == phase:
            return str(c.get("lastTransitionTime") or rfc3339(now))
    return rfc3339(now)


class DatasetController:
    """Keeps every CacheDataset's status (:func:`dataset_status`) from the Nodes, through ``kube``
    (:class:`cachefs.kube.KubeClient`). With ``lease`` (``namespace/name`` of a coordination.k8s.io Lease), only
    the replica holding it writes: it renews it every pass, and another takes it over once it is ``LEASE_SECONDS``
    old."""

    LEASE_SECONDS = 20

    def __init__(self, kube, *, interval: float = INTERVAL, clock=time.time, lease: str = "",
                 identity: str = "") -> None:
        self.kube, self.interval, self.clock = kube, interval, clock
        self.lease, self.identity = lease, identity or socket.gethostname()

    async def leading(self) -> bool:
        """Whether this replica holds the lease now (taking or renewing it), always True without one."""
        if not self.lease:
            return True
        ns, _, name = self.lease.partition("/")
        path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
        now = self.clock()
        stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            lease = await self.kube.get(f"{path}/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
                    "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.LEASE_SECONDS,
                             "acquireTime": stamp, "renewTime": stamp}}
            return await self._write("POST", path, body)
        spec = lease.get("spec") or {}
        holder, renewed = spec.get("holderIdentity"), spec.get("renewTime") or ""
        try:
            age = now - datetime.strptime(renewed, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
        except ValueError:
            age = float("inf")
        if holder != self.identity and age < self.LEASE_SECONDS:
            return False
        spec.update({"holderIdentity": self.identity, "renewTime": stamp, "leaseDurationSeconds": self.LEASE_SECONDS})
        if holder != self.identity:
            spec["acquireTime"] = stamp
        return await self._write("PUT", f"{path}/{name}", {**lease, "spec": spec})  # (its resourceVersion: no race)

    async def _write(self, method: str, path: str, body: dict) -> bool:
        try:
            await self.kube.request(method, path, body)
        except ApiError as exc:
            if exc.status == 409:  # another replica wrote it first
                return False
            raise
        return True

    async def once(self) -> int:
        """One pass: the statuses written (those that changed)."""
        if not await self.leading():
            return 0
        objs = (await self.kube.get(f"{API}/cachedatasets")).get("items") or []
        if not objs:
            return 0
        nodes = (await self.kube.get("/api/v1/nodes")).get("items") or []
        written = 0
        now = self.clock()
        for obj in objs:
            status = dataset_status(obj, nodes, now)
            old = obj.get("status") or {}
            if _figures(old) == _figures(status) and old.get("rate") == status.get("rate"):
                continue
            meta = obj.get("metadata") or {}
            path = f"{API}/namespaces/{meta.get('namespace')}/cachedatasets/{meta.get('name')}/status"
            try:
                await self.kube.merge_patch(path, {"status": status})
                written += 1
            except Exception as exc:  # noqa: BLE001 - (gone meanwhile, or the API busy: the next pass writes it)
                log.warning("%s/%s: status not written: %s", meta.get("namespace"), meta.get("name"), exc)
        return written

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception as exc:  # noqa: BLE001 - the API unreachable for a while: the next pass tries again
                log.warning("dataset statuses: %s", exc)
            await asyncio.sleep(self.interval)

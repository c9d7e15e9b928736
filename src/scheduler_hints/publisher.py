"""The publisher: the node agent's loop that keeps its own Node's cachefs labels and annotations current.

It only ever touches its own Node, with a JSON merge patch carrying the Node's ``resourceVersion`` (so a
concurrent change by kubelet or another writer makes the API server answer 409, and we re-read and
recompute rather than remove a label someone else just set). The RBAC it needs is ``get`` and ``patch`` on
``nodes`` (see ``deploy/``).

Churn is bounded three ways: dataset labels move in 5-point buckets with hysteresis (:mod:`.labels`); the
exact-figure annotations are rewritten only when a label changes, when a dataset's cached bytes moved by
more than ``annotation_delta`` of its size, or when they are older than ``annotation_max_age``; and at most
one PATCH is sent per ``min_interval`` seconds. Labels of datasets no longer held are removed.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cachefs.kube import ApiError, KubeClient
from scheduler_hints.labels import DATASET_PREFIX, NODE_ANNOTATION, desired_metadata, is_ours
from scheduler_hints.summary import SummarySource

__all__ = ["PublishResult", "Publisher", "metadata_patch", "rbac_hint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishResult:
    patched: bool
    labels_changed: tuple[str, ...] = ()
    labels_removed: tuple[str, ...] = ()


def _figures(annotation: str | None) -> tuple[int, int] | None:
    try:
        d = json.loads(annotation or "")
        return int(d["cachedBytes"]), int(d["totalBytes"])
    except (ValueError, KeyError, TypeError):
        return None


def _updated_at(annotation: str | None) -> float | None:
    try:
        ts = json.loads(annotation or "")["updatedAt"]
        return float(calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, KeyError, TypeError):
        return None


def metadata_patch(current_labels: Mapping[str, str], current_annotations: Mapping[str, str],
                   labels: Mapping[str, str], annotations: Mapping[str, str], *, now: float,
                   annotation_delta: float = 0.01, annotation_max_age: float = 600.0) -> dict[str, dict[str, Any]]:
    """The ``metadata`` part of a merge patch taking a node from its current cachefs metadata to the desired
    one: changed labels set, our stale labels/annotations set to ``None`` (removed), annotations rewritten
    only when worth it (see module docstring). Empty when nothing needs to change."""
    out_labels: dict[str, Any] = {k: v for k, v in labels.items() if current_labels.get(k) != v}
    out_labels.update({k: None for k in current_labels if is_ours(k) and k not in labels})
    out_ann: dict[str, Any] = {k: None for k in current_annotations if is_ours(k) and k not in annotations}
    for key, value in annotations.items():
        old = current_annotations.get(key)
        if old is None or key in out_labels:
            out_ann[key] = value
            continue
        age = now - (_updated_at(old) or 0.0)
        if age > annotation_max_age:
            out_ann[key] = value
        elif key.startswith(DATASET_PREFIX + "/"):
            a, b = _figures(old), _figures(value)
            if a is None or b is None or a[1] != b[1] or abs(a[0] - b[0]) > annotation_delta * max(1, b[1]):
                out_ann[key] = value
        elif key == NODE_ANNOTATION and old != value:
            try:
                o, n = json.loads(old), json.loads(value)
                if abs(int(o["freeBytes"]) - int(n["freeBytes"])) > annotation_delta * max(1, int(n["capacityBytes"])):
                    out_ann[key] = value
            except (ValueError, KeyError, TypeError):
                out_ann[key] = value
    patch: dict[str, dict[str, Any]] = {}
    if out_labels:
        patch["labels"] = out_labels
    if out_ann:
        patch["annotations"] = out_ann
    return patch


def rbac_hint(exc: ApiError) -> str:
    """What to add to a refused PATCH's message."""
    return (" (the node agent needs get and patch on nodes, and may change only the Node it runs on)"
            if exc.status == 403 else "")


class Publisher:
    """Publishes ``summary`` onto Node ``node_name``; :meth:`publish_once` for one round, :meth:`run` forever."""

    def __init__(self, client: KubeClient, node_name: str, summary: SummarySource, *, min_interval: float = 30.0,
                 annotation_delta: float = 0.01, annotation_max_age: float = 600.0, max_attempts: int = 5,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.node_name = node_name
        self.summary = summary
        self.min_interval = min_interval
        self.annotation_delta = annotation_delta
        self.annotation_max_age = annotation_max_age
        self.max_attempts = max_attempts
        self._clock = clock
        self._last_patch = float("-inf")
        self.patches = 0

    @property
    def _path(self) -> str:
        return f"/api/v1/nodes/{self.node_name}"

    async def publish_once(self, *, force: bool = False) -> PublishResult:
        """Read the node, compute the patch, send it if non-empty (unless rate-limited; ``force`` ignores the
        rate limit). Conflicts and retryable API errors are retried with backoff; others are raised."""
        if not force and self._clock() - self._last_patch < self.min_interval:
            return PublishResult(False)
        delay = 0.2
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await self._round()
            except ApiError as exc:
                if not exc.retryable or attempt == self.max_attempts:
                    raise
                log.info("publishing labels on node %s: %s (attempt %d, retrying)", self.node_name, exc, attempt)
            except (TimeoutError, OSError) as exc:
                if attempt == self.max_attempts:
                    raise
                log.info("publishing labels on node %s: %s (attempt %d, retrying)", self.node_name, exc, attempt)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    async def _round(self) -> PublishResult:
        node = await self.client.get(self._path)
        meta = node.get("metadata") or {}
        cur_labels, cur_ann = meta.get("labels") or {}, meta.get("annotations") or {}
        now = self._clock()
        labels, annotations = desired_metadata(self.summary.summary(), cur_labels, now=now)
        patch: dict[str, Any] = metadata_patch(cur_labels, cur_ann, labels, annotations, now=now,
                               annotation_delta=self.annotation_delta, annotation_max_age=self.annotation_max_age)
        if not patch:
            return PublishResult(False)
        patch["resourceVersion"] = meta.get("resourceVersion")
        await self.client.merge_patch(self._path, {"metadata": patch})
        self._last_patch = now
        self.patches += 1
        changed = tuple(sorted(k for k, v in (patch.get("labels") or {}).items() if v is not None))
        removed = tuple(sorted(k for k, v in (patch.get("labels") or {}).items() if v is None))
        log.info("node %s: labels set %s, removed %s", self.node_name, changed, removed)
        return PublishResult(True, changed, removed)

    async def run(self, interval: float = 10.0, stop: asyncio.Event | None = None) -> None:
        """Publish every ``interval`` seconds until ``stop`` is set; API trouble is logged and retried next round."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self.publish_once()
            except ApiError as exc:
                log.warning("publishing labels on node %s failed: %s%s", self.node_name, exc, rbac_hint(exc))
            except (TimeoutError, OSError) as exc:
                log.warning("publishing labels on node %s failed: %s", self.node_name, exc)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass

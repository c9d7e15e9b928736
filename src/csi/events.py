"""Warning events on the pods whose volumes this node pod generation could not take over from the previous one
(docs/UPGRADES.md "Version skew"): the previous generation keeps serving them, and a user looking at the pod sees why
(``kubectl describe pod``: ``SessionNotTakenOver``), besides ``cachefs status`` on the node.

The mounter notes the sessions it left (:func:`cachefs.index.mounts.record_left_behind`); the node plugin, which
knows the pods each session serves (its publish records carry the pod kubelet named), says it once per pod and
session. Needs API access (in-cluster, or ``--kubeconfig``) and the right to create events; without either the
note stays in ``cachefs status`` alone.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading

from cachefs.base.errors import ConfigError
from cachefs.index.mounts import left_behind
from csi.api import ApiAccess
from csi.publishes import recorded_volume

__all__ = ["EVENTS_INTERVAL", "REASON", "PodEvents"]

log = logging.getLogger("cachefs.csi")

#: Seconds between looks at the sessions left behind.
EVENTS_INTERVAL = 5.0
REASON = "SessionNotTakenOver"


class PodEvents:
    """Says, once per pod and session, why a pod's volume stays with the previous node pod generation."""

    def __init__(self, node_id: str, kubeconfig: str | None = None) -> None:
        self.node_id, self.api = node_id, ApiAccess(kubeconfig)
        self._said: set[tuple[str, str]] = set()  # (pod uid, session mountpoint)
        self._off = False

    def run(self, sessions, stop: threading.Event) -> None:
        """Look every :data:`EVENTS_INTERVAL` seconds until ``stop`` (a thread of the node plugin)."""
        while not self._off:
            try:
                self.say_left_behind(sessions)
            except Exception as exc:  # noqa: BLE001 - events are best effort; the next look tries again
                log.warning("pod events about sessions left behind: %s", exc)
            if stop.wait(EVENTS_INTERVAL):
                return

    def say_left_behind(self, sessions) -> int:
        """Post an event for each pod whose session the mounter left behind and that was not told yet; how many."""
        left = left_behind(sessions.cache_dir)
        if not left:
            return 0
        todo = []
        for rec in list(sessions.publishes.values()):
            pod = rec.get("pod") or {}
            mnt = sessions.session_path(recorded_volume(rec))
            why = left.get(mnt)
            if why and pod.get("uid") and (pod["uid"], mnt) not in self._said:
                todo.append((pod, mnt, why))
        if not todo:
            return 0
        try:
            return asyncio.run(self._post(todo))
        except ConfigError as exc:
            log.info("no pod events about sessions left behind (cachefs status says it): %s", exc)
            self._off = True
            return 0

    async def _post(self, todo: list[tuple[dict, str, str]]) -> int:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        posted = 0
        async with self.api.client() as client:
            for pod, mnt, why in todo:
                ns = pod.get("namespace") or "default"
                await client.post(f"/api/v1/namespaces/{ns}/events", {
                    "apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "cachefs-session-", "namespace": ns},
                    "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod.get("name", ""), "namespace": ns,
                                       "uid": pod["uid"]},
                    "reason": REASON, "type": "Warning", "count": 1, "firstTimestamp": now, "lastTimestamp": now,
                    "source": {"component": "cachefs-csi", "host": self.node_id},
                    "message": f"this pod's cachefs volume stays with the previous node pod generation, which keeps "
                               f"serving it: {why}"})
                self._said.add((pod["uid"], mnt))
                posted += 1
        return posted

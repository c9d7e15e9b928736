"""Shared FUSE sessions and the bind mounts that put them at pods' target paths.

One dataset (same URL and origin options) has one FUSE session per node, mounted under the state directory
at ``sessions/<key>/mnt`` by a :class:`~.mounter.Mounter` (in a deployment, the node pod's mounter container,
so that the session's holder outlives restarts of this plugin's container; the holder in turn keeps the mount
alive across restarts of the FUSE daemon). Each pod's target path is a bind mount of it (read-only for datasets), so a
second pod starts warm and removing a pod removes only its bind mount. A session no pod uses is stopped after
an idle time (its daemon's memory comes back); the cached data stays on disk (eviction, not pod churn, decides
what stays cached), so the next pod of the dataset starts warm all the same.

What is published where is recorded in ``publishes.json`` (no secrets), so a restarted plugin can check
every target and repair what is broken: a session that died is mounted again and its targets re-bound.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from cachefs.base.errors import CacheFSError
from cachefs.base.files import atomic_write
from cachefs.fuse.mount import bind_mount, is_fuse_mount, is_mount_point, is_stale_mount, other_mounts_of, unmount
from cachefs.index.volumes import wait_uploaded
from csi.mounter import LocalMounter, Mounter, MountRequest
from csi.publishes import record_path, recorded_volume
from csi.volume import DatasetVolume

__all__ = ["SessionManager"]

log = logging.getLogger("cachefs.csi")


class SessionManager:
    """Sessions and publishes of one node. ``cache_dir`` is the node's cache; ``state_dir`` holds sessions and
    the publish record; ``mounter`` starts sessions (default: holders started by this process)."""

    def __init__(self, state_dir: str, cache_dir: str, mounter: Mounter | None = None, *,
                 drain_timeout: float = 90.0) -> None:
        self.state_dir, self.cache_dir = os.path.abspath(state_dir), os.path.abspath(cache_dir)
        #: How long the last unpublish of a writable volume on this node waits for its uploads (kubelet's own
        #: timeout for the call is two minutes).
        self.drain_timeout = drain_timeout
        self.sessions_dir = os.path.join(self.state_dir, "sessions")
        os.makedirs(self.sessions_dir, exist_ok=True)
        # Sessions are mounted allow_other (pods read as any user): only root may walk to them on the node; pods
        # reach them through their own bind mounts.
        os.chmod(self.sessions_dir, 0o700)
        self.mounter = mounter or LocalMounter(self.cache_dir)
        # The credentials each session was first mounted with, to mount it again if its holder dies (memory
        # only: secrets are not written to the node's disk; after a restart of both this plugin and the mounter,
        # a repair mounts with the node's own credentials, and the next publish of the volume brings them back).
        self._env: dict[str, dict[str, str]] = {}
        self._idle_since: dict[str, float] = {}  # session key → when it was first seen unused
        self._record_path = record_path(self.state_dir)
        self._lock = threading.Lock()  # guards the record file and session start-up
        self.publishes: dict[str, dict] = self._load()

    # -- sessions -------------------------------------------------------------------------------------------
    def session_path(self, vol: DatasetVolume) -> str:
        return os.path.join(self.sessions_dir, vol.session_key, "mnt")

    def ensure_session(self, vol: DatasetVolume, env: dict[str, str] | None = None) -> str:
        """The mounted, healthy session of ``vol`` (mounted now if needed); returns its mount point."""
        mnt = self.session_path(vol)
        with self._lock:
            self._idle_since.pop(vol.session_key, None)  # in use again: restart its idle clock
            if is_fuse_mount(mnt) and not is_stale_mount(mnt):
                return mnt
            os.makedirs(mnt, exist_ok=True)
            if env:
                self._env[vol.session_key] = dict(env)
            self.mounter.mount(MountRequest(vol.url, mnt, vol.endpoint_url, vol.region,
                                            dict(env or self._env.get(vol.session_key, {})),
                                            group=vol.group, mode=vol.file_mode, sampler=vol.sampler,
                                            writable=vol.writable))
            log.info("session for %s mounted at %s", vol.url, mnt)
            return mnt

    def session_healthy(self, vol: DatasetVolume) -> bool:
        mnt = self.session_path(vol)
        return is_fuse_mount(mnt) and not is_stale_mount(mnt)

    def stop_idle_sessions(self, idle_for: float) -> list[str]:
        """Unmount sessions that no recorded publish and no bind mount has used for ``idle_for`` seconds (their
        holders and daemons exit; the cache stays); returns their keys. Called by the repair loop."""
        in_use = {recorded_volume(rec).session_key for rec in self.publishes.values()}
        stopped, now = [], time.monotonic()
        with self._lock:
            for key in sorted(os.listdir(self.sessions_dir)):
                mnt = os.path.join(self.sessions_dir, key, "mnt")
                if key in in_use or other_mounts_of(mnt):
                    self._idle_since.pop(key, None)
                    continue
                if now - self._idle_since.setdefault(key, now) < idle_for:
                    continue
                if is_mount_point(mnt):
                    unmount(mnt)
                for path in (mnt, os.path.dirname(mnt)):  # empty directories only: never a walk into a mount
                    try:
                        os.rmdir(path)
                    except FileNotFoundError:
                        pass
                self._idle_since.pop(key, None)
                self._env.pop(key, None)
                stopped.append(key)
        if stopped:
            log.info("stopped %d idle session(s): %s", len(stopped), ", ".join(stopped))
        return stopped

    # -- publishes ------------------------------------------------------------------------------------------
    def is_published(self, target: str, vol: DatasetVolume) -> bool:
        rec = self.publishes.get(target)
        return bool(rec and rec["volume_id"] == vol.volume_id and rec.get("group") == vol.group and is_mount_point(target)
                    and not is_stale_mount(target))

    def publish(self, vol: DatasetVolume, target: str, env: dict[str, str] | None = None, *,
                readonly: bool = False, pod: dict[str, str] | None = None) -> None:
        """Bind the session of ``vol`` at ``target`` (created if missing): read-only, unless ``vol`` is a writable
        volume the pod does not mount read-only. ``pod``: the pod kubelet named (name, namespace, uid), recorded
        so that events about the session reach it."""
        src = self.ensure_session(vol, env)
        os.makedirs(target, exist_ok=True)
        if is_mount_point(target):  # a broken earlier bind (stale session): replace it
            unmount(target)
        bind_mount(src, target, readonly=readonly or not vol.writable)
        self._record(target, {"volume_id": vol.volume_id, "attributes": vol.attributes(), "group": vol.group,
                              "readonly": readonly, **({"pod": pod} if pod else {})})

    def unpublish(self, target: str) -> None:
        """Remove the bind mount at ``target`` and the directory; the shared session stays. The last pod of a
        writable volume on this node leaving waits (up to ``drain_timeout``) until what it wrote is uploaded."""
        rec = self.publishes.get(target)
        vol = recorded_volume(rec) if rec else None
        if vol is not None and vol.writable and not any(
                t != target and recorded_volume(r).session_key == vol.session_key for t, r in self.publishes.items()):
            done, pending = wait_uploaded(self.cache_dir, self.session_path(vol), self.drain_timeout)
            if not done:
                log.warning("%s: %d uploads still pending after %.0f s; they stay on this node and go on in the "
                            "background", target, len(pending), self.drain_timeout)
        while is_mount_point(target):
            unmount(target)
        if os.path.isdir(target):
            try:
                os.rmdir(target)
            except OSError as exc:
                log.warning("leaving %s in place: %s", target, exc)
        elif os.path.lexists(target):
            os.unlink(target)
        self._record(target, None)

    def recover(self) -> list[str]:
        """After a restart: re-mount dead sessions and re-bind broken or missing targets; returns the repaired
        targets."""
        repaired = []
        for target, rec in list(self.publishes.items()):
            vol = recorded_volume(rec)
            if self.is_published(target, vol) and self.session_healthy(vol):
                continue
            if not os.path.isdir(os.path.dirname(target)):
                log.info("dropping the record of %s: its pod directory is gone", target)
                self._record(target, None)
                continue
            try:
                self.publish(vol, target, readonly=bool(rec.get("readonly")))
                repaired.append(target)
            except (CacheFSError, OSError) as exc:
                log.error("could not repair %s: %s", target, exc)
        return repaired

    def condition(self, target: str) -> tuple[bool, str]:
        """(abnormal, message) of a published target."""
        if not is_mount_point(target):
            return True, "not mounted"
        if is_stale_mount(target):
            return True, "the FUSE session behind this mount is gone (transport endpoint is not connected)"
        return False, "ok"

    # -- record ---------------------------------------------------------------------------------------------
    def _load(self) -> dict[str, dict]:
        try:
            with open(self._record_path) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except ValueError:
            log.error("%s is corrupt; starting with no recorded publishes", self._record_path)
            return {}

    def _record(self, target: str, rec: dict | None) -> None:
        with self._lock:
            if rec is None:
                self.publishes.pop(target, None)
            else:
                self.publishes[target] = rec
            # The publish record must outlive the node's processes (kubelet asks again after a reboot).
            atomic_write(self._record_path, json.dumps(self.publishes, indent=1, sort_keys=True), fsync=True)

"""Node pod generations: a node pod takes over the FUSE sessions of the one it replaces, so that the DaemonSet is
updated without draining the node (docs/UPGRADES.md).

Each node pod's session keeper (:mod:`cachefs.fuse.keeper`) listens at ``<keepers dir>/<generation>.sock``, a
host path both generations see (``generation`` is the pod's UID). A starting mounter asks every other keeper there
what it keeps (:func:`predecessors`), and starts a holder for each session it can take (:func:`takeable`) with
``--adopt`` and that keeper's socket: the new holder takes a copy of the descriptor, asks the old holder to
retire (it kills its daemon and exits without unmounting; readers wait), and its own daemon resumes from the mount
journal and asks the kernel to resend what the old one had read. A session whose hand-over version this release
does not know stays with the generation that serves it (which keeps serving), and the mount records say so for
``cachefs status`` (:func:`cachefs.index.mounts.record_left_behind`).

On its way out a node pod waits: its mounter until each of its holders has retired or its mount has ended, its
CSI plugin until its keeper keeps nothing (:func:`successor_present` says whether it waits for a successor or for
the volumes' pods to go).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

from cachefs.base.errors import CacheFSError
from cachefs.fuse.keeper import HANDOVER_VERSION, kept_sessions

__all__ = ["answers", "predecessors", "successor_present", "takeable"]

log = logging.getLogger("cachefs.csi.generations")

def answers(path: str) -> bool:
    """Whether something listens on the unix socket ``path`` (a socket file left by a dead process refuses)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _others(own: str) -> list[str]:
    """The other generations' keeper sockets beside ``own``, oldest first; sockets nobody answers (a generation
    that is gone) are removed."""
    folder = os.path.dirname(own)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if not name.endswith(".sock") or path == own:
            continue
        if answers(path):
            with contextlib.suppress(OSError):
                found.append((os.lstat(path).st_mtime, path))
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return [p for _, p in sorted(found)]


def predecessors(own: str) -> dict[str, dict[str, dict]]:
    """``{keeper socket: {mountpoint: meta}}`` of the other generations' keepers beside ``own`` (this
    generation's keeper socket)."""
    out = {}
    for path in _others(own):
        try:
            out[path] = kept_sessions(path)
        except CacheFSError as exc:  # (it went away meanwhile)
            log.warning("%s", exc)
    return out


def successor_present(own: str) -> bool:
    """Whether another generation's keeper answers beside ``own`` (a node pod replacing this one)."""
    return bool(_others(own))


def takeable(meta: dict) -> str:
    """Why a session of another generation (its keeper's ``meta``) cannot be taken over, or "" when it can."""
    version = meta.get("handover")
    argv = meta.get("argv")
    if not isinstance(version, int):
        return ("its node pod generation predates the hand-over between generations: it keeps serving until its pods "
                "end (drain the node to move it)")
    if version > HANDOVER_VERSION:
        return (f"its node pod generation (release {meta.get('release', '?')}) hands sessions over in version "
                f"{version}, this one knows up to {HANDOVER_VERSION}: it stays with that generation, which keeps "
                "serving it")
    if not isinstance(argv, list) or not argv:
        return "the keeper's copy names no holder command"
    return ""

"""The node plugin's record of what it published where (``publishes.json`` in its state directory, no secrets):
written by :mod:`.sessions`, read back by a restarted plugin, and by the mounter, which takes over the sessions pods
use before the idle ones."""

from __future__ import annotations

import json
import os

from csi.volume import DatasetVolume

__all__ = ["record_path", "recorded_volume", "sessions_in_use"]


def record_path(state_dir: str) -> str:
    return os.path.join(state_dir, "publishes.json")


def recorded_volume(rec: dict) -> DatasetVolume:
    """The volume a publish record names, for the group it was published for."""
    return DatasetVolume.from_attributes(rec["attributes"]).for_group(rec.get("group"))


def sessions_in_use(state_dir: str) -> set[str]:
    """Keys of the sessions a recorded publish uses (a pod's volume), from the plugin's record in ``state_dir``."""
    try:
        with open(record_path(state_dir)) as f:
            publishes = json.load(f)
        return {recorded_volume(rec).session_key for rec in publishes.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()

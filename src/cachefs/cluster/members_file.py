"""The node's view of its cache group, shared with the node's other cachefs processes through a file.

The agent follows the group's membership (:mod:`.membership`) and writes what it sees to
``<cache dir>/cluster/members.json`` (atomically, at every change and every :data:`REWRITE_EVERY` seconds).
Readers on the node (FUSE daemons, prefetch, ``cachefs::`` users) read it to ask the group's members for bytes
themselves, without a hop through the agent. A file older than :data:`STALE_AFTER` means the agent is gone:
readers then read as if alone (their own disk, the mirror, the origin), which is slower but never wrong.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from cachefs.base.files import atomic_write
from cachefs.cluster.members import Member

__all__ = ["REWRITE_EVERY", "STALE_AFTER", "MembersRecord", "members_path", "placement_path", "read_members",
           "write_members"]

REWRITE_EVERY = 30.0
STALE_AFTER = 120.0


@dataclass(frozen=True)
class MembersRecord:
    """What the agent wrote: the group, this node's name in it, its members (draining ones included) and how
    to authenticate to them."""

    group: str
    self_name: str
    members: dict[str, Member]
    draining: frozenset[str]
    token_file: str = ""
    secret_file: str = ""
    written_at: float = 0.0
    #: TLS between members: the group's certificate, key and CA files ("" each: plain HTTP).
    tls: tuple[str, str, str] = ("", "", "")


def members_path(cache_dir: str) -> str:
    return os.path.join(cache_dir, "cluster", "members.json")


def placement_path(cache_dir: str) -> str:
    """The agent's placement table for its members (readers load it rather than build it)."""
    return os.path.join(cache_dir, "cluster", "placement.npz")


def write_members(cache_dir: str, view: MembersRecord) -> None:
    doc = {"group": view.group, "self": view.self_name, "written_at": time.time(),
           "token_file": view.token_file, "secret_file": view.secret_file, "tls": list(view.tls),
           "members": [{"name": m.name, "address": m.address, "weight": m.weight,
                        "draining": m.name in view.draining} for m in view.members.values()]}
    atomic_write(members_path(cache_dir), json.dumps(doc), dir_mode=0o700)


def read_members(cache_dir: str, *, stale_after: float = STALE_AFTER) -> MembersRecord | None:
    """The agent's view, or None when there is none, it is stale, or it does not parse."""
    try:
        with open(members_path(cache_dir)) as f:
            doc = json.load(f)
        written = float(doc["written_at"])
        if time.time() - written > stale_after:
            return None
        members = {str(m["name"]): Member(str(m["name"]), str(m["address"]), float(m["weight"]))
                   for m in doc["members"]}
        draining = frozenset(str(m["name"]) for m in doc["members"] if m.get("draining"))
        tls = tuple(str(x) for x in doc.get("tls") or ("", "", ""))
        if len(tls) != 3:
            return None
        return MembersRecord(str(doc["group"]), str(doc["self"]), members, draining, str(doc.get("token_file") or ""),
                         str(doc.get("secret_file") or ""), written, tls)
    except (OSError, ValueError, KeyError, TypeError):
        return None

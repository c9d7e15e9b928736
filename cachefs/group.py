"""This process's link to the node's cache group.

The node's agent writes who is in the group to a file in the cache directory (:mod:`cachefs.cluster.members_file`);
every cachefs process on the node follows that file and reads through the group with it: missing bytes are
asked of their owners (:class:`~cachefs.tiers.PeerTier`) before the mirror and the origin, and a dataset without
a manifest here takes one from a member instead of listing the bucket. Without the file (no agent, or a stale
one) the process reads alone, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from cachefs.base.errors import CacheFSError
from cachefs.base.types import DatasetRef, Entry
from cachefs.cluster.members_file import STALE_AFTER, GroupView, members_path, placement_path, read_members
from cachefs.cluster.tls import GroupTLS
from cachefs.manifest.shipping import pack_manifest, unpack_manifest
from cachefs.tiers import PeerTier

__all__ = ["GroupLink", "manifest_key"]

log = logging.getLogger(__name__)

#: Members asked for a dataset's manifest, in rank order.
MANIFEST_CANDIDATES = 4


def manifest_key(ds_id: str) -> bytes:
    """The placement key of a dataset's manifest: its owner lists the bucket for the group."""
    return b"m" + ds_id.encode()


class GroupLink:
    """Follows the members file of ``cache_dir``; :meth:`refresh` now and then (cheap: one stat)."""

    def __init__(self, cache_dir: str, *, block_size: int, hedge_after: float = 0.25, keep_guest: bool = True,
                 declared: list[tuple[str, int]] | None = None) -> None:
        self.cache_dir = cache_dir
        #: Whether this process is the node's agent, which fetches for the group rather than reading through it.
        self.serving = False
        # The member table (a cluster.MemberTable) and the peer client, made when the node first joins a group:
        # a process on a node without one never loads what they need (numpy, ~25 MiB and 0.1 s).
        self.table = None
        self.client = None
        self.view: GroupView | None = None
        # What peers send is stored as guest data (evicted first) with ``keep_guest``; without, readers keep it in
        # memory for a while and a node's disk holds only what it owns.
        # ``declared``: the cluster.replicas prefixes (sets known to be hot, spread from the start).
        self.block_tier = PeerTier(self, kind="block", block_size=block_size, hedge_after=hedge_after,
                                   kept=keep_guest, declared=declared)
        self.small_tier = PeerTier(self, kind="small", hedge_after=hedge_after, kept=keep_guest, declared=declared)
        self._stamp: tuple[float, int] | None = None
        self.refresh()

    @property
    def joined(self) -> bool:
        return self.view is not None

    def refresh(self) -> bool:
        """Re-read the members file if it changed (or went stale); returns whether the membership changed."""
        try:
            st = os.stat(members_path(self.cache_dir))
            stamp: tuple[float, int] | None = (st.st_mtime, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp and (self.view is None or time.time() - self.view.written_at <= STALE_AFTER):
            return False
        self._stamp = stamp
        view = read_members(self.cache_dir) if stamp is not None else None
        if view is None:
            if self.view is not None:
                log.warning("cache group: %s is gone or stale; reading without the group",
                            members_path(self.cache_dir))
            self.view = None
            return self.table.replace({}, frozenset()) if self.table is not None else False
        if self.table is None:
            from cachefs.cluster.membership import MemberTable
            from cachefs.cluster.peer_client import PeerClient

            self.table, self.client = MemberTable("", grace=float("inf")), PeerClient("", None)
        self.view = view
        self.table.self_name = view.self_name
        self.client.identify_as(view.self_name, view.secret_file or view.token_file or None, GroupTLS.of(*view.tls))
        return self.table.replace(view.members, view.draining, made=self._agents_table)

    def _agents_table(self, members):
        """The table the agent wrote for exactly these members, if it did (a group of thousands: seconds saved)."""
        from cachefs.cluster.placement import Placement

        return Placement.load(placement_path(self.cache_dir), members)

    async def manifest(self, ref: DatasetRef) -> list[Entry] | None:
        """The dataset's current manifest from the member that lists it for the group, or None (then this process
        lists it). A reader asks the manifest's owners in order, its own node's agent included; an agent
        (:attr:`serving`) asks only those ranked before itself, so two agents never wait on each other."""
        client = self.client
        if not self.joined or client is None:
            return None
        owners = self.table.placement.owners(manifest_key(ref.id), MANIFEST_CANDIDATES)
        if self.serving and self.table.self_name in owners:
            owners = owners[: owners.index(self.table.self_name)]
        for name in owners:
            member = self.table.member(name)
            if member is None:
                continue
            try:
                raw = await client.manifest(member.address, ref.id, url=ref.url)
                if raw is not None:
                    return unpack_manifest(raw, ref.url)
            except CacheFSError as exc:
                log.info("%s: no manifest from %s (%s)", ref.url, name, exc)
        return None

    async def push_manifest(self, ref: DatasetRef, store, version: int) -> int:
        """Hand the manifest version this node just took of ``ref`` to the other members (``cachefs refresh``):
        those that know the dataset make it their current version. Returns how many took it; a member that is
        down or declines is logged, not an error (it keeps its snapshot until its own refresh)."""
        client = self.client
        if not self.joined or client is None:
            return 0
        raw = await asyncio.to_thread(pack_manifest, store, ref.id, version, ref.url)
        took = 0
        for name, member in self.table.members.items():
            if name == self.table.self_name or not self.table.active(name):
                continue
            try:
                took += await client.push_manifest(member.address, ref.id, ref.url, raw)
            except CacheFSError as exc:
                log.info("%s: %s did not take the new manifest (%s)", ref.url, name, exc)
        if took:
            log.info("%s: manifest v%d handed to %d member(s) of the group", ref.url, version, took)
        return took

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

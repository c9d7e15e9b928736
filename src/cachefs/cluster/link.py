"""This process's link to the node's cache group.

The node's agent writes who is in the group to a file in the cache directory (:mod:`cachefs.cluster.members_file`);
every cachefs process on the node follows that file and reads through the group with it: the read path's peer tier
asks the owners of missing bytes through :attr:`GroupLink.view` (a narrow, read-only view of the group) before the
mirror and the origin, and a dataset without a manifest here takes one from a member instead of listing the
bucket. Without the file (no agent, or a stale one) the process reads alone, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from cachefs.base.errors import CacheFSError
from cachefs.base.types import DatasetRef, Entry
from cachefs.cluster.keys import MANIFEST_CANDIDATES, manifest_key
from cachefs.cluster.members_file import STALE_AFTER, MembersRecord, members_path, placement_path, read_members
from cachefs.cluster.tls import GroupTLS
from cachefs.manifest.shipping import pack_manifest, unpack_manifest

if TYPE_CHECKING:
    from cachefs.cluster.membership import MemberTable
    from cachefs.cluster.peer_client import PeerClient

__all__ = ["GroupLink", "GroupView"]

log = logging.getLogger(__name__)


class GroupView(Protocol):
    """What the read path may see of the group: read-only, and current (the table and client appear when the node
    joins a group and stay None while it is in none)."""

    @property
    def table(self) -> MemberTable | None: ...

    @property
    def client(self) -> PeerClient | None: ...

    @property
    def serving(self) -> bool:
        """Whether this process is the node's agent, which fetches for the group rather than reading through it."""
        ...


class _LinkView:
    """A :class:`GroupView` of one link: properties only, nothing to call that changes the link."""

    __slots__ = ("_link",)

    def __init__(self, link: GroupLink) -> None:
        self._link = link

    @property
    def table(self) -> MemberTable | None:
        return self._link.table

    @property
    def client(self) -> PeerClient | None:
        return self._link.client

    @property
    def serving(self) -> bool:
        return self._link.serving


class GroupLink:
    """Follows the members file of ``cache_dir``; :meth:`refresh` now and then (cheap: one stat)."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        #: Whether this process is the node's agent, which fetches for the group rather than reading through it.
        self.serving = False
        # The member table and the peer client, made when the node first joins a group: a process on a node without
        # one never loads what they need (numpy, ~25 MiB and 0.1 s).
        self.table: MemberTable | None = None
        self.client: PeerClient | None = None
        self.record: MembersRecord | None = None
        #: The read path's view of the group (the peer tier's).
        self.view: GroupView = _LinkView(self)
        self._stamp: tuple[float, int] | None = None
        self.refresh()

    @property
    def joined(self) -> bool:
        return self.record is not None

    def refresh(self) -> bool:
        """Re-read the members file if it changed (or went stale); returns whether the membership changed."""
        try:
            st = os.stat(members_path(self.cache_dir))
            stamp: tuple[float, int] | None = (st.st_mtime, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp and (self.record is None or time.time() - self.record.written_at <= STALE_AFTER):
            return False
        self._stamp = stamp
        record = read_members(self.cache_dir) if stamp is not None else None
        if record is None:
            if self.record is not None:
                log.warning("cache group: %s is gone or stale; reading without the group",
                            members_path(self.cache_dir))
            self.record = None
            return self.table.replace({}, frozenset()) if self.table is not None else False
        if self.table is None or self.client is None:
            from cachefs.cluster.membership import MemberTable
            from cachefs.cluster.peer_client import PeerClient

            self.table, self.client = MemberTable("", grace=float("inf")), PeerClient("", None)
        self.record = record
        self.table.self_name = record.self_name
        self.client.identify_as(record.self_name, record.secret_file or record.token_file or None,
                                GroupTLS.of(*record.tls))
        return self.table.replace(record.members, record.draining, made=self._agents_table)

    def _agents_table(self, members):
        """The table the agent wrote for exactly these members, if it did (a group of thousands: seconds saved)."""
        from cachefs.cluster.placement import Placement

        return Placement.load(placement_path(self.cache_dir), members)

    async def manifest(self, ref: DatasetRef) -> list[Entry] | None:
        """The dataset's current manifest from the member that lists it for the group, or None (then this process
        lists it). A reader asks the manifest's owners in order, its own node's agent included; an agent
        (:attr:`serving`) asks only those ranked before itself, so two agents never wait on each other."""
        client, table = self.client, self.table
        if not self.joined or client is None or table is None:
            return None
        owners = table.placement.owners(manifest_key(ref.id), MANIFEST_CANDIDATES)
        if self.serving and table.self_name in owners:
            owners = owners[: owners.index(table.self_name)]
        for name in owners:
            member = table.member(name)
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
        client, table = self.client, self.table
        if not self.joined or client is None or table is None:
            return 0
        raw = await asyncio.to_thread(pack_manifest, store, ref.id, version, ref.url)
        took = 0
        for name, member in table.members.items():
            if name == table.self_name or not table.active(name):
                continue
            try:
                took += await client.push_manifest(member.address, ref.id, ref.url, raw)
            except CacheFSError as exc:
                log.info("%s: %s did not take the new manifest (%s)", ref.url, name, exc)
        if took:
            log.info("%s: manifest v%d handed to %d member(s) of the group", ref.url, version, took)
        return took

    async def evict_everywhere(self, ref: DatasetRef) -> dict[str, int | str | None]:
        """Have every member drop what it caches of ``ref`` (``cachefs evict --group``: purge a dataset a member
        may have poisoned). This node's own agent is asked too: its cache directory is this process's, but it may
        still hold the evicted files open. Member → bytes freed, None when it does not know the dataset, or why
        it could not be asked. Empty when this process is in no group."""
        self.refresh()
        client, table = self.client, self.table
        if not self.joined or client is None or table is None:
            return {}
        out: dict[str, int | str | None] = {}
        for name, member in sorted(table.members.items()):
            try:
                out[name] = await client.evict(member.address, ref.id, ref.url)
            except CacheFSError as exc:
                out[name] = str(exc)
        return out

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

"""Copies of closed checkpoint files on other members of the node's cache group, until their upload.

``checkpoint.replicas`` members (default 1) hold each file a volume closes before ``close`` returns, so an
acknowledged checkpoint survives the loss of the node that wrote it (:mod:`cachefs.agent.replicas` on their side).
Which members: the first reachable of the file's owners by the group's placement, this node left out. Outside a
group, or with ``replicas: 0``, there are none. After the upload the copies are dropped; a rename before it re-keys
them; a member that mounts the volume meanwhile lists them (:meth:`Replicator.held`) and reads from them.
"""

from __future__ import annotations

import asyncio
import logging

from cachefs.base.checksum import block_hasher
from cachefs.base.types import dataset_id
from cachefs.cluster.link import GroupView
from cachefs.cluster.peer_client import PeerError
from cachefs.cluster.placement import RANK

__all__ = ["Replicator"]

log = logging.getLogger(__name__)


class Replicator:
    """The copies of one volume's files (``url``), through the node's group (``view``)."""

    def __init__(self, view: GroupView | None, url: str, copies: int) -> None:
        self.view, self.url, self.copies = view, url, copies
        self.volume = dataset_id(url)

    @property
    def wanted(self) -> int:
        """How many copies a closed file should have elsewhere now (0 outside a group)."""
        if self.view is None or self.view.table is None or self.view.client is None:
            return 0
        others = [n for n in self.view.table.members if n != self.view.table.self_name]
        return min(self.copies, len(others))

    def _candidates(self, key: str) -> list[str]:
        """The other members, the file's owners by placement first."""
        table = self.view.table if self.view is not None else None
        if table is None:
            return []
        first = table.placement.owners(f"replica:{self.volume}:{key}".encode(), RANK)
        rest = sorted(set(table.members) - set(first))
        return [n for n in [*first, *rest] if n != table.self_name]

    async def push(self, entry: int, key: str, path: str, size: int) -> list[str]:
        """Send the file to ``wanted`` members; the ones that hold it now (fewer when members refuse or are gone)."""
        want = self.wanted
        if want == 0:
            return []
        assert self.view is not None and self.view.table is not None and self.view.client is not None
        checksum = await asyncio.to_thread(_checksum, path, size)
        held: list[str] = []
        for name in self._candidates(key):
            member = self.view.table.member(name)
            if member is None:
                continue
            try:
                await self.view.client.put_replica(member.address, self.volume, entry, self.url, key, path, size,
                                                   checksum)
            except PeerError as exc:
                log.warning("%s/%s: member %s did not take its copy: %s", self.url, key, name, exc)
                continue
            held.append(name)
            if len(held) == want:
                break
        return held

    async def drop(self, members: list[str], entry: int) -> None:
        for name in members:
            await self._quietly(name, "drop_replica", entry)

    async def rekey(self, members: list[str], entry: int, key: str) -> None:
        for name in members:
            await self._quietly(name, "rekey_replica", entry, key)

    async def _quietly(self, name: str, op: str, *args) -> None:
        if self.view is None or self.view.table is None or self.view.client is None:
            return
        member = self.view.table.member(name)
        if member is None:
            return
        try:
            await getattr(self.view.client, op)(member.address, self.volume, *args)
        except PeerError as exc:  # its copy is dropped when it restarts without us (see the agent's store)
            log.info("member %s: %s of %s entry %s failed: %s", name, op, self.url, args[0], exc)

    async def held(self) -> dict[str, tuple[str, str, int]]:
        """Every copy the group's live members hold of this volume: key → (member, entry, size)."""
        if self.view is None or self.view.table is None or self.view.client is None:
            return {}
        out: dict[str, tuple[str, str, int]] = {}
        for name in sorted(self.view.table.members):
            member = self.view.table.member(name)
            if member is None:
                continue
            try:
                for r in await self.view.client.replicas(member.address, self.volume):
                    out.setdefault(str(r["key"]), (name, str(r["entry"]), int(r["size"])))
            except PeerError as exc:
                log.info("member %s: no listing of its copies of %s: %s", name, self.url, exc)
        return out

    async def fetch(self, member: str, entry: str, fd: int, size: int) -> None:
        """Write the copy ``member`` holds into ``fd``."""
        if self.view is None or self.view.table is None or self.view.client is None:
            raise FileNotFoundError(2, f"no cache group to restore {entry} of {self.url} from")
        m = self.view.table.member(member)
        if m is None:
            raise FileNotFoundError(2, f"member {member}, which holds a copy, has left the group")
        await self.view.client.get_replica(m.address, self.volume, entry, fd, size)


def _checksum(path: str, size: int) -> int:
    hasher = block_hasher()
    with open(path, "rb") as f:
        left = size
        while left > 0:
            chunk = f.read(min(left, 8 << 20))
            if not chunk:
                break
            hasher.update(chunk)
            left -= len(chunk)
    return hasher.intdigest()

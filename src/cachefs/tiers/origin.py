"""The origin itself (S3, a file tree, any fsspec URL), through the origin funnel's limits."""

from __future__ import annotations

from cachefs.node.funnel import OriginFunnel
from cachefs.tiers.base import Kind, Served, Tier, TierParts, Want

__all__ = ["OriginTier"]


class OriginTier(Tier):
    name = "origin"

    def __init__(self, funnel: OriginFunnel) -> None:
        self.funnel = funnel

    @classmethod
    def build(cls, parts: TierParts, kind: Kind) -> OriginTier:
        return cls(parts.funnel)

    async def fetch(self, want: Want) -> Served:
        data = await self.funnel.get(want.ds.source, want.ds.object_url(want.entry), want.entry.version, want.start,
                                     want.length, want.wanted)
        return Served(data, self.name)

"""Where missing bytes come from: an ordered chain of tiers behind one interface (see :mod:`.base`)."""

from cachefs.tiers.base import TIERS, BatchRef, Keep, Served, Tier, TierChain, TierCounts, TierParts, Want, build_chain
from cachefs.tiers.mirror import MirrorTier
from cachefs.tiers.origin import OriginTier
from cachefs.tiers.peer import PeerTier

TIERS.update({t.name: t for t in (PeerTier, MirrorTier, OriginTier)})

__all__ = ["TIERS", "BatchRef", "Keep", "MirrorTier", "OriginTier", "PeerTier", "Served", "Tier", "TierChain", "TierCounts",
           "TierParts", "Want", "build_chain"]

"""Where missing bytes come from: an ordered chain of tiers behind one interface (see :mod:`.base`)."""

from cachefs.tiers.base import Tier, TierChain, TierCounts, Want
from cachefs.tiers.mirror import MirrorTier
from cachefs.tiers.origin import OriginTier
from cachefs.tiers.peer import PeerTier

__all__ = ["MirrorTier", "OriginTier", "PeerTier", "Tier", "TierChain", "TierCounts", "Want"]

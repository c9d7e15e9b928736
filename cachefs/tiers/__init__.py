"""Where missing bytes come from: an ordered chain of tiers behind one interface (see :mod:`.base`)."""

from .base import Tier, TierChain, TierCounts, Want
from .mirror import MirrorTier
from .origin import OriginTier
from .peer import PeerTier

__all__ = ["MirrorTier", "OriginTier", "PeerTier", "Tier", "TierChain", "TierCounts", "Want"]

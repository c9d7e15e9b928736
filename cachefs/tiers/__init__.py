"""Where missing bytes come from: an ordered chain of tiers behind one interface (see :mod:`.base`)."""

from .base import Tier, TierChain, TierCounts, Want
from .mirror import MirrorTier
from .origin import OriginTier

__all__ = ["MirrorTier", "OriginTier", "Tier", "TierChain", "TierCounts", "Want"]

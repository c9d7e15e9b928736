"""The one seam for where missing bytes come from.

A read path that misses asks a :class:`TierChain` for ``length`` bytes at ``start`` of one object version
(:class:`Want`). The chain asks its tiers in order; each returns the bytes, None when it does not have them,
or raises. A tier that is not the last one failing is not the reader's problem: it is counted as a fallback
(with why) and the next tier is asked; only the last tier's errors reach the reader. Every tier counts the
bytes it served.

Today's chains: small files ask the packed mirror, then the origin; blocks ask the origin. A tier for the
cache group's peers goes in front of both, without a change to the block or pack code.
"""

from __future__ import annotations

import abc
import logging
import threading
from dataclasses import dataclass

from cachefs.base.errors import CacheFSError
from cachefs.base.types import Entry
from cachefs.manifest.dataset import Dataset

__all__ = ["Tier", "TierChain", "TierCounts", "Want"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Want:
    """``length`` bytes at ``start`` of ``entry`` (one version of one object of ``ds``; ``okey`` its cache key)."""

    ds: Dataset
    entry: Entry
    okey: bytes
    start: int
    length: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.length == self.entry.size


class Tier(abc.ABC):
    #: The tier's name in counters and metrics (``origin``, ``mirror``, ``peer``).
    name: str
    #: Whether what this tier serves is stored on this node (a cache group's peers may keep it for us instead).
    kept: bool = True
    #: Whether what it serves, when stored, is guest data: another group member owns it, so it is evicted first.
    guest: bool = False

    @abc.abstractmethod
    async def fetch(self, want: Want) -> bytes | bytearray | None:
        """Exactly ``want.length`` bytes, or None if this tier does not have them; raises
        :class:`~cachefs.base.errors.CacheFSError` when it should have had them and failed."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and background work."""


class TierCounts:
    """Bytes served and fallbacks per tier, since start (thread-safe; the metrics read them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes: dict[str, int] = {}
        self.fallbacks: dict[tuple[str, str], int] = {}  # (tier, reason) → count

    def served(self, tier: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[tier] = self.bytes.get(tier, 0) + nbytes

    def fell_back(self, tier: str, reason: str) -> None:
        with self._lock:
            self.fallbacks[tier, reason] = self.fallbacks.get((tier, reason), 0) + 1

    def snapshot(self) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        with self._lock:
            return dict(self.bytes), dict(self.fallbacks)


class TierChain:
    """Tiers asked in order; the last one always answers (or its error is the reader's)."""

    def __init__(self, tiers: list[Tier], counts: TierCounts) -> None:
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers, self.counts = tiers, counts

    async def fetch(self, want: Want) -> bytes | bytearray:
        return (await self.fetch_from(want))[0]

    async def fetch_from(self, want: Want) -> tuple[bytes | bytearray, Tier]:
        """The bytes and the tier that served them."""
        *first, last = self.tiers
        for tier in first:
            try:
                data = await tier.fetch(want)
            except CacheFSError as exc:
                log.warning("%s: %s; reading %s from the next tier", tier.name, exc, want.entry.path)
                self.counts.fell_back(tier.name, type(exc).__name__)
                continue
            if data is not None:
                self.counts.served(tier.name, len(data))
                return data, tier
        data = await last.fetch(want)
        if data is None:
            raise CacheFSError(f"{want.entry.path}: no tier could serve it")
        self.counts.served(last.name, len(data))
        return data, last

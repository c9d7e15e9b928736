"""Which cached objects and packs go first when the cache must shrink: the eviction policy, chosen by configuration
(``cache.eviction_policy``, a name in :data:`POLICIES`, as JuiceFS picks its ``KeyIndex``).

A policy sees the candidates (every object and pack of the node, with its access statistics) and the node's
:class:`EvictionHints`, and answers the order to let them go, victims first; what it leaves out it keeps. Hints are
what the node knows beyond access statistics. They live in the index (:mod:`cachefs.index.hints`), so every
process on the node evicts by the same policy and the same hints. Two things are never candidates, whatever the
policy: bytes that are staged (written here and not yet uploaded) and bytes a running prefetch job brought in
(:attr:`EvictionHints.keep_newer_than`).

* ``two-touch-lru`` (the default): objects read at most once go first, oldest first, then objects read twice or
  more, oldest first. One-off scans and a dataset streamed once therefore cannot push out data that jobs keep
  coming back to; ``bench/eviction_bench.py`` measures it against LRU, FIFO and random (better than each on
  skewed and hot-plus-scan traces, close to random on pure epoch scans).
* ``lru``: least recently used first.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from cachefs.base.errors import ConfigError
from cachefs.index.records import ObjectRecord, PackRecord

__all__ = ["LRU", "POLICIES", "Candidate", "EvictionHints", "EvictionPolicy", "NextUse", "TwoTouchLRU", "policy_named"]


class NextUse(Protocol):
    """What the node knows of the next use of its files: the declared read orders
    (:class:`cachefs.prefetch.orders.OrderBook`)."""

    def passed(self, dataset: str, path: str) -> bool:
        """Whether every declared order holding ``path`` has had its reader go past it this epoch."""
        ...


@dataclass(frozen=True, slots=True)
class Candidate:
    """A cached object (``okey`` its object key) or pack (``okey`` None) that eviction may take."""

    okey: bytes | None
    record: ObjectRecord | PackRecord

    @property
    def key(self) -> bytes:
        """The object key, or the pack key: what staging and hints name."""
        if self.okey is not None:
            return self.okey
        assert isinstance(self.record, PackRecord)
        return self.record.key()

    @property
    def last_access(self) -> float:
        return self.record.last_access

    @property
    def hits(self) -> int:
        return self.record.hits


@dataclass(frozen=True)
class EvictionHints:
    """What a policy may know beyond a candidate's recency and use count (read from the index before each
    eviction): leases and pins."""

    #: Bytes used at or after this time stay: a prefetch job is filling the cache, and what it brought must not
    #: be evicted to make room for the rest of it (a selection larger than the cache fails clearly instead).
    keep_newer_than: float | None = None
    #: Keys of staged bytes (written on this node, not yet uploaded): never evicted.
    staged: frozenset[bytes] = field(default_factory=frozenset)
    #: Datasets pinned on this node (a CacheDataset's ``spec.pin``, ``cachefs pin``): left to an explicit purge.
    pinned: frozenset[str] = field(default_factory=frozenset)


class EvictionPolicy(abc.ABC):
    """Orders candidates for eviction. Implementations rank; the protections every policy keeps are applied here."""

    #: The policy's name in ``cache.eviction_policy``.
    name: ClassVar[str]

    def order(self, candidates: Iterable[Candidate], hints: EvictionHints) -> list[Candidate]:
        """The candidates this policy lets go, victims first; staged bytes, pinned datasets and what a running
        prefetch job brought are left out whatever the policy."""
        keep_newer, pinned = hints.keep_newer_than, hints.pinned
        allowed = [c for c in candidates
                   if (keep_newer is None or c.last_access < keep_newer) and c.key not in hints.staged
                   and (not pinned or c.record.dataset not in pinned)]
        return self.rank(allowed, hints)

    @abc.abstractmethod
    def rank(self, candidates: list[Candidate], hints: EvictionHints) -> list[Candidate]:
        """``candidates`` in the order to evict them (victims first); any left out are kept."""


class TwoTouchLRU(EvictionPolicy):
    name = "two-touch-lru"

    def rank(self, candidates: list[Candidate], hints: EvictionHints) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.hits >= 2, c.last_access))


class LRU(EvictionPolicy):
    name = "lru"

    def rank(self, candidates: list[Candidate], hints: EvictionHints) -> list[Candidate]:
        return sorted(candidates, key=lambda c: c.last_access)


#: Policies by name (``cache.eviction_policy``).
POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (TwoTouchLRU, LRU)}


def policy_named(name: str) -> EvictionPolicy:
    """The policy ``cache.eviction_policy`` names; ConfigError for an unknown name."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"cache.eviction_policy: unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return cls()

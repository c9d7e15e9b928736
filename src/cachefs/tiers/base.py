"""The one seam for where missing bytes come from.

A read path that misses asks a :class:`TierChain` for ``length`` bytes at ``start`` of one object version
(:class:`Want`). The chain asks its tiers in order; each answers what it was asked and nothing else: a
:class:`Served` (the bytes, and what the caller should keep of them), None when it does not have them, or an
error. A tier never fills the cache: the read strategy that asked installs what came back, as mountpoint-s3's
multilevel cache fills its own local level. A tier that is not the last one failing is not the reader's problem:
it is counted as a fallback (with why) and the next tier is asked; only the last tier's errors reach the reader.
Every tier counts the bytes it served.

A tier may bring more than it was asked: the packed mirror fetches a window of a pack holding the file and its
neighbours. It answers with that *batch* beside the bytes (:attr:`Served.batch`), says what to read ahead after it
(:meth:`Tier.batches_after`) and fetches those batches when asked (:meth:`Tier.fetch_batch`); the caller installs
batches whole and schedules the read-ahead, whichever tier they came from. Memory: the caller holds it for the
bytes it asked for (``want.length``) for as long as it has them; a tier holds memory only for what it brings beyond
that (the rest of a batch). Tiers with work in flight let the engine wait for it (:meth:`Tier.drain`) or cancel it
(:meth:`Tier.stop`), and say why a dataset cannot use them (:meth:`Tier.problem`, shown by ``cachefs status``).

Chains come from configuration (``engine.small_tiers``, ``engine.block_tiers``): names looked up in
:data:`TIERS` (as fsspec's ``known_implementations``), each class building itself from :class:`TierParts`.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from cachefs.base.errors import CacheFSError, ConfigError
from cachefs.base.types import Entry
from cachefs.manifest.dataset import Dataset

if TYPE_CHECKING:
    from cachefs.base.config import Config
    from cachefs.cluster.link import GroupView
    from cachefs.formats.mirror_index import MirrorWindow
    from cachefs.node.budget import Reservation
    from cachefs.node.funnel import OriginFunnel

__all__ = ["TIERS", "BatchRef", "Keep", "Kind", "Served", "Tier", "TierChain", "TierCounts", "TierParts", "Want", "build_chain"]

log = logging.getLogger(__name__)

#: What a chain fetches: whole blocks of large objects, or whole small files.
Kind = Literal["block", "small"]


@dataclass(frozen=True, slots=True)
class Want:
    """``length`` bytes at ``start`` of ``entry`` (one version of one object of ``ds``; ``okey`` its cache key)."""

    ds: Dataset
    entry: Entry
    okey: bytes
    start: int
    length: int
    #: For read-ahead: whether it is still worth fetching when the origin funnel can start its GET.
    wanted: Callable[[], bool] | None = None

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.length == self.entry.size


class Keep(enum.Enum):
    """What the caller should keep of what a tier served."""

    #: This node's own data: store it.
    OWN = "own"
    #: Another member of the cache group owns it: store it as guest data (evicted first), if there is room.
    GUEST = "guest"
    #: Do not store it: the member that owns it keeps it.
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Served:
    """What a tier answered: exactly the bytes asked for, the tier's name, what to keep, and the batch the bytes
    came in when the tier fetched more than asked (a window of a pack: the caller may install it whole)."""

    data: bytes | bytearray
    tier: str
    keep: Keep = Keep.OWN
    batch: MirrorWindow | None = None


@dataclass(frozen=True, slots=True)
class BatchRef:
    """A batch to read ahead: its dataset, the tier that offers it, where it is (``pack``, ``window``), its size,
    and the key of its pack's first member (whether that pack is here already)."""

    ds_id: str
    tier: str
    pack: int
    window: int
    nbytes: int
    first: bytes | None


@dataclass(frozen=True)
class TierParts:
    """What tiers are built from: the configuration, the origin funnel, the cache group's view."""

    config: Config
    funnel: OriginFunnel
    group: GroupView


class Tier(abc.ABC):
    #: The tier's name in configuration, counters and metrics (``origin``, ``mirror``, ``peer``).
    name: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def build(cls, parts: TierParts, kind: Kind) -> Tier | None:
        """The tier for a chain of ``kind``, or None when it has nothing for that kind (a mirror holds no blocks)."""

    @abc.abstractmethod
    async def fetch(self, want: Want) -> Served | None:
        """Exactly ``want.length`` bytes, or None if this tier does not have them; raises
        :class:`~cachefs.base.errors.CacheFSError` when it should have had them and failed."""

    def batches_after(self, batch: MirrorWindow) -> list[BatchRef]:
        """What to read ahead after ``batch`` (one this tier served), in order; a tier without batches has none."""
        return []

    async def fetch_batch(self, ds: Dataset, ref: BatchRef, held: Reservation | None) -> MirrorWindow:
        """The batch ``ref`` names (one of :meth:`batches_after`'s). ``held``: memory reserved for it already (the
        prefetcher's), used for the fetch or given back."""
        if held is not None:
            await held.release()
        raise CacheFSError(f"tier {self.name} serves no batches")

    def problem(self, ds_id: str) -> str | None:
        """Why dataset ``ds_id`` cannot use this tier although it has something for it (None: no problem)."""
        return None

    async def drain(self) -> None:  # noqa: B027 - optional hook
        """Wait for the fetches this tier has in flight of its own (beyond the asks it is answering)."""

    def stop(self) -> list[asyncio.Future]:
        """The fetches of its own in flight, for the engine to cancel at shutdown."""
        return []

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

    def tier(self, name: str) -> Tier | None:
        """The chain's tier called ``name``, if it has one."""
        return next((t for t in self.tiers if t.name == name), None)

    async def fetch(self, want: Want) -> Served:
        """What the first tier that has the bytes served."""
        *first, last = self.tiers
        for tier in first:
            try:
                served = await tier.fetch(want)
            except CacheFSError as exc:
                log.warning("%s: %s; reading %s from the next tier", tier.name, exc, want.entry.path)
                self.counts.fell_back(tier.name, type(exc).__name__)
                continue
            if served is not None:
                self.counts.served(tier.name, len(served.data))
                return served
        served = await last.fetch(want)
        if served is None:
            raise CacheFSError(f"{want.entry.path}: no tier could serve it")
        self.counts.served(last.name, len(served.data))
        return served

    def batches_after(self, served: Served) -> list[BatchRef]:
        """What to read ahead after the batch ``served`` came in (none if it came alone)."""
        tier = self.tier(served.tier)
        return tier.batches_after(served.batch) if tier is not None and served.batch is not None else []

    async def fetch_batch(self, ds: Dataset, ref: BatchRef, held: Reservation | None) -> MirrorWindow:
        """The batch ``ref`` names, from the tier that offered it."""
        tier = self.tier(ref.tier)
        if tier is None:
            if held is not None:
                await held.release()
            raise CacheFSError(f"no tier {ref.tier} in this chain")
        return await tier.fetch_batch(ds, ref, held)

    def problem(self, ds_id: str) -> str | None:
        """The first of the tiers' problems with dataset ``ds_id``."""
        return next((p for t in self.tiers if (p := t.problem(ds_id)) is not None), None)

    async def drain(self) -> None:
        for tier in self.tiers:
            await tier.drain()

    def stop(self) -> list[asyncio.Future]:
        return [f for tier in self.tiers for f in tier.stop()]

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()


#: Tier classes by name (filled by :mod:`cachefs.tiers`); chains name them in ``engine.small_tiers`` /
#: ``engine.block_tiers``.
TIERS: dict[str, type[Tier]] = {}


def build_chain(names: tuple[str, ...], parts: TierParts, kind: Kind, counts: TierCounts) -> TierChain:
    """The chain of ``kind`` that ``names`` configure (tiers with nothing for that kind are left out)."""
    tiers: list[Tier] = []
    for name in names:
        cls = TIERS.get(name)
        if cls is None:
            raise ConfigError(f"engine: unknown tier {name!r} (known: {', '.join(sorted(TIERS))})")
        tier = cls.build(parts, kind)
        if tier is not None:
            tiers.append(tier)
    if not tiers:
        raise ConfigError(f"engine: no tier serves {kind} reads (tiers {', '.join(names)})")
    return TierChain(tiers, counts)

"""All-or-nothing placement of pod groups (gangs) without the classic deadlock.

The deadlock: 6 free GPUs, two 4-GPU gangs arrive together, each gets 3 GPUs' worth of members placed, both
wait forever for the rest. Two rules prevent it:

1. **Admission before placement.** The filter verb lets a gang's pods through only once the gang is
   *admitted*, and a gang is admitted only if the free GPUs, minus what already-admitted gangs still need,
   can hold the whole gang. The second gang in the example is not admitted: its pods stay pending and hold
   nothing; it is admitted when GPUs free up (kube-scheduler retries pending pods on its own).
2. **Binding waits for the whole gang.** The bind verb holds each member's bind until all ``minMember``
   members have a node (then binds them all), or gives up after ``bind_timeout`` and reports an error, so
   kube-scheduler forgets the placement and retries the pod later. Nothing of a gang is bound unless
   everything is.

Admissions expire when a gang makes no progress for ``ttl`` seconds, and all state is in memory: an
extender that crashes loses only waiting binds, which kube-scheduler sees fail and retries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_hints.metrics import GANG_ADMISSIONS
from scheduler_hints.pods import GangRef

__all__ = ["GangManager"]


@dataclass
class _Gang:
    ref: GangRef
    need_gpus: int
    admitted_at: float
    last_progress: float
    members: dict[str, tuple[str, int]] = field(default_factory=dict)  # pod key -> (node, gpus)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    bound: set[str] = field(default_factory=set)

    @property
    def held_gpus(self) -> int:
        return sum(g for _, g in self.members.values())


class GangManager:
    def __init__(self, *, ttl: float = 300.0, bind_timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.bind_timeout = bind_timeout
        self._clock = clock
        self._gangs: dict[str, _Gang] = {}

    def _expire(self) -> None:
        now = self._clock()
        for key, g in list(self._gangs.items()):
            if not g.complete.is_set() and now - g.last_progress > self.ttl:
                del self._gangs[key]

    def outstanding_gpus(self, exclude: str | None = None) -> int:
        """GPUs admitted gangs still need beyond the members already placed."""
        self._expire()
        return sum(max(0, g.need_gpus - g.held_gpus) for k, g in self._gangs.items()
                   if k != exclude and not g.complete.is_set())

    def admitted(self, gang: GangRef) -> bool:
        return gang.key in self._gangs

    def fits(self, gang: GangRef, pod_gpus: int, free_gpus: int) -> bool:
        """Whether ``free_gpus`` (cluster-wide, now) minus admitted gangs' outstanding needs can hold all
        ``min_member`` pods of ``pod_gpus`` each."""
        return free_gpus - self.outstanding_gpus() >= gang.min_member * pod_gpus

    def admit(self, gang: GangRef, pod_gpus: int, free_gpus: int) -> bool:
        """Admit ``gang`` if it :meth:`fits`."""
        self._expire()
        if gang.key in self._gangs:
            return True
        if not self.fits(gang, pod_gpus, free_gpus):
            GANG_ADMISSIONS.labels("refused").inc()
            return False
        now = self._clock()
        self._gangs[gang.key] = _Gang(gang, gang.min_member * pod_gpus, now, now)
        GANG_ADMISSIONS.labels("admitted").inc()
        return True

    def placed(self, gang: GangRef) -> list[tuple[str, int]]:
        """(node, GPUs) of the gang's members placed so far (waiting in bind)."""
        g = self._gangs.get(gang.key)
        return list(g.members.values()) if g else []

    def reservations(self) -> list[tuple[str, str, int]]:
        """(pod key, node, GPUs) of members placed and not yet bound: those waiting for their gang, and those of a
        complete gang whose binds are still on their way (their GPUs must not look free in between)."""
        return [(pod, n, g) for gang in self._gangs.values() for pod, (n, g) in gang.members.items()
                if pod not in gang.bound]

    async def wait_for_gang(self, gang: GangRef, pod: str, node: str, gpus: int) -> bool:
        """Called by the bind verb: place ``pod`` on ``node`` and wait until the whole gang is placed.
        True means bind now; False means the gang could not complete in time (the member is released)."""
        g = self._gangs.get(gang.key)
        if g is None:  # admitted by an earlier extender process, or expired: admit on the spot
            now = self._clock()
            g = self._gangs[gang.key] = _Gang(gang, gang.min_member * gpus, now, now)
        g.members[pod] = (node, gpus)
        g.last_progress = self._clock()
        if len(g.members) >= gang.min_member:
            g.complete.set()
        try:
            await asyncio.wait_for(g.complete.wait(), self.bind_timeout)
            return True
        except TimeoutError:
            g.members.pop(pod, None)
            if not g.members:
                self._gangs.pop(gang.key, None)
            return False

    def bound(self, gang: GangRef, pod: str) -> None:
        """A member was bound; once all are, the gang's admission is finished."""
        g = self._gangs.get(gang.key)
        if g is None:
            return
        g.bound.add(pod)
        if g.complete.is_set() and g.bound >= set(g.members):
            del self._gangs[gang.key]

    def failed(self, gang: GangRef, pod: str) -> None:
        """Binding a member failed at the API server: release it so the gang can re-form."""
        g = self._gangs.get(gang.key)
        if g is not None:
            g.members.pop(pod, None)

"""Single-flight: at most one run of a piece of work per key at a time; whoever asks meanwhile shares it.

A hundred readers of one cold block cause one GET; a directory read ahead and a reader asking for one of its
files share one fetch. Call from the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from typing import Any

from cachefs.node import speculation

__all__ = ["SingleFlight"]


class SingleFlight:
    """Runs keyed by any hashable; a run's entry goes when it finishes (its outcome is marked seen: those who
    await it get any exception themselves)."""

    def __init__(self) -> None:
        self._runs: dict[Hashable, asyncio.Future] = {}
        self._speculations: dict[Hashable, speculation.Speculation] = {}  # runs started by read-ahead

    def __contains__(self, key: Hashable) -> bool:
        return key in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, key: Hashable) -> asyncio.Future | None:
        """The key's run, to share it: a reader that shares a run read-ahead started promotes it (the funnel then
        serves it as the reader's, :mod:`cachefs.node.speculation`)."""
        fut = self._runs.get(key)
        if fut is not None and speculation.current() is None:
            s = self._speculations.get(key)
            if s is not None:
                s.promote()
        return fut

    def start(self, key: Hashable, coro: Coroutine[Any, Any, Any]) -> asyncio.Future:
        """Run ``coro`` as the key's run (the caller knows there is none)."""
        fut = asyncio.ensure_future(coro)
        self._runs[key] = fut
        s = speculation.current()
        if s is not None:
            self._speculations[key] = s

        def done(f: asyncio.Future) -> None:
            if self._runs.get(key) is f:
                del self._runs[key]
                self._speculations.pop(key, None)
            if not f.cancelled():
                f.exception()  # (marked seen)

        fut.add_done_callback(done)
        return fut

    def join(self, key: Hashable, make: Callable[[], Coroutine[Any, Any, Any]]) -> tuple[asyncio.Future, bool]:
        """The key's run, started with ``make()`` if there is none; (its future, whether this call started it)."""
        fut = self.get(key)
        if fut is not None:
            return fut, False
        return self.start(key, make()), True

    def runs(self) -> list[asyncio.Future]:
        """The runs in flight now (for shutdown)."""
        return list(self._runs.values())

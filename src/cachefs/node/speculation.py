"""Whether the work running now is speculative (read-ahead) or wanted by a reader: the origin funnel serves
readers first (:mod:`cachefs.node.funnel`).

The prefetcher runs each hint inside :func:`speculating`; whatever that work awaits (a single-flight fetch it
starts, the funnel's GET) sees the :class:`Speculation` through a context variable, as asyncio copies the
context into every task it makes. A reader that comes to share a speculative fetch :meth:`promotes
<Speculation.promote>` it: from then on it is a reader's fetch, wherever it is waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

__all__ = ["NotWanted", "Speculation", "current", "speculating"]


class NotWanted(Exception):
    """Read-ahead given up at the origin funnel: by the time its GET could start, :attr:`Speculation.wanted`
    said no."""


class Speculation:
    """One piece of read-ahead work, until a reader wants it. ``wanted``, when the work sets it: whether it is
    still worth its GET (asked as the funnel is about to start it, which may be a while after it was planned)."""

    __slots__ = ("_on_promote", "promoted", "wanted")

    def __init__(self) -> None:
        self.promoted = False
        self.wanted: Callable[[], bool] | None = None
        self._on_promote: list[Callable[[], None]] = []

    def promote(self) -> None:
        """A reader waits for this work now."""
        if self.promoted:
            return
        self.promoted = True
        callbacks, self._on_promote = self._on_promote, []
        for callback in callbacks:
            callback()

    def on_promote(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when a reader comes for this work."""
        if self.promoted:
            callback()
        else:
            self._on_promote.append(callback)

    def forget(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._on_promote.remove(callback)


_current: ContextVar[Speculation | None] = ContextVar("cachefs_speculation", default=None)


def current() -> Speculation | None:
    """The speculation the running work belongs to; None for a reader's work (or one a reader came for)."""
    s = _current.get()
    return None if s is None or s.promoted else s


@contextlib.contextmanager
def speculating() -> Iterator[Speculation]:
    """Run the block (and the tasks it starts) as read-ahead."""
    s = Speculation()
    token = _current.set(s)
    try:
        yield s
    finally:
        _current.reset(token)

"""Who may be bound where: only a pod our filter let through, only to a node it passed, once per filter, within
:data:`BINDABLE_FOR` seconds. A forged or replayed ``/bind`` binds nothing (docs/SECURITY.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from scheduler_hints.memo import room

__all__ = ["BINDABLE_FOR", "BindingGuard", "NotHeld"]

#: Seconds after our filter let a pod through during which it may be bound to one of the nodes it passed.
BINDABLE_FOR = 300.0


class NotHeld(Exception):
    """A bind of a pod this extender does not hold for binding there (403)."""


class BindingGuard:
    """Pods held for binding: pod key → (the nodes the filter passed, when), by ``clock``."""

    def __init__(self, clock: Callable[[], float], hold_for: float = BINDABLE_FOR) -> None:
        self.clock, self.hold_for = clock, hold_for
        self._held: dict[str, tuple[list, float]] = {}

    def hold(self, key: str, passed: list) -> None:
        """``passed``: the node names, or Node objects, the filter let pod ``key`` through to (kept as they are:
        looked through only if the pod is bound)."""
        room(self._held, 100_000)[key] = (passed, self.clock())

    def take(self, key: str, namespace: str, name: str, node: str) -> None:
        """Let pod ``key`` be bound to ``node`` once (a second, replayed bind is refused), or raise NotHeld."""
        held = self._held.get(key)
        if held is not None and self.clock() - held[1] <= self.hold_for:
            if any(n == node if isinstance(n, str) else _name(n) == node for n in held[0]):
                del self._held[key]
                return
        raise NotHeld(f"pod {namespace}/{name} is not held for binding to {node}: it did not pass this extender's "
                      "filter there")

    def forget(self, key: str) -> None:
        self._held.pop(key, None)


def _name(node: Mapping[str, Any]) -> Any:
    return (node.get("metadata") or {}).get("name")

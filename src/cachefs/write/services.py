"""What a writable volume takes from its node, as one value: the front door that opens volumes builds it once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from cachefs.cluster.link import GroupView
    from cachefs.node.budget import MemoryBudget

__all__ = ["NodeServices", "RoomMaker"]


class RoomMaker(Protocol):
    def __call__(self, need: int) -> int:
        """Free about ``need`` bytes of the cache disk; the bytes freed. Blocking."""


@dataclass(frozen=True)
class NodeServices:
    """``budget``: the memory uploads and downloads read their parts within; ``make_room``: the read cache's
    eviction, asked first when staged bytes need disk; ``group``: the cache group that holds copies of closed files
    until their upload. Each may be absent (a volume alone on a node)."""

    #: None of them.
    NONE: ClassVar[NodeServices]

    budget: MemoryBudget | None = None
    make_room: RoomMaker | None = None
    group: GroupView | None = None


NodeServices.NONE = NodeServices()

"""A cache group's member as every part of the group sees it, and the static member list (``--peers``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Member", "parse_peers"]


@dataclass(frozen=True)
class Member:
    """A member: a stable name (its node's), where its peer server listens, and its weight (cache capacity)."""

    name: str
    address: str  # host:port
    weight: float = 1.0


def parse_peers(spec: str) -> dict[str, Member]:
    """``name=host:port[@weight],…`` → members (``--peers``)."""
    out: dict[str, Member] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, rest = item.partition("=")
        address, _, weight = rest.partition("@")
        host, _, port = address.rpartition(":")
        if not sep or not name or not host or not port.isdigit():
            raise ValueError(f"--peers: {item!r} is not NAME=HOST:PORT[@WEIGHT]")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"--peers: {item!r}: the weight is not a number") from None
        if w <= 0:
            raise ValueError(f"--peers: {item!r}: the weight must be positive")
        out[name] = Member(name, address, w)
    return out

"""Two small helpers for the extender's memos: bounded dicts, and which entries of a list were replaced."""

from __future__ import annotations

from itertools import compress
from operator import is_not

__all__ = ["replaced", "room"]


def room(d: dict, limit: int) -> dict:
    """``d`` with its oldest entries dropped so that one more fits under ``limit`` (every memo and clock of the
    extender is bounded this way)."""
    while len(d) >= limit:
        d.pop(next(iter(d)))
    return d


def replaced(new: list, old: list) -> list[int]:
    """The positions at which ``new`` holds another object than ``old`` (lists of one length). What is kept per
    object stays right where the object is the same one."""
    return list(compress(range(len(new)), map(is_not, new, old)))

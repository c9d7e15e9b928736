"""Waiting in tests for what another process makes true (no timed sleeps as assertions)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_for"]

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 60.0, what: str = "condition", interval: float = 0.05) -> T:
    """``check()``'s first true value, asked every ``interval`` seconds; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")

"""fallocate(2) modes Python's ``os`` does not offer: space allocated without changing a file's size, and
holes punched to give a range's blocks back."""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["allocate_ahead", "punch_hole"]

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def allocate_ahead(fd: int, offset: int, length: int) -> bool:
    """Allocate blocks for ``[offset, offset + length)`` without changing the file's size; False if the file
    system refused (full, or no support)."""
    return _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the blocks of ``[offset, offset + length)`` back (they read as zeros); False if not supported."""
    return _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0

"""Keeping the process's RSS within the engine's memory budget.

glibc serves large allocations with ``mmap`` only below a threshold that it raises every time such a block is
freed; after a burst of 4 MiB fetch buffers the freed memory stays in the heap, so RSS tracks the *peak*
ever in flight rather than what is in flight now. Pinning the threshold at one block makes every fetch
buffer an ``mmap`` returned to the kernel on ``free``. Measured by bench/memory_bench.py (64 readers in
1 MiB reads, 128 MiB budget): RSS growth +206 MiB without, +125–131 MiB with (the readers' own 1 MiB
results included); no throughput change on a 1 Gbit/s link, though pure loopback reads get ~25 % slower
from the extra page faults.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["bound_allocator"]

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Free memory at the top of a heap that glibc keeps rather than hands back. Pinning the mmap threshold also
#: pins this at its 128 KiB default, so every freed 1 MiB read (a FUSE READ's most, and the piece blocks are
#: verified in) went back to the kernel and the next one faulted in and zeroed 256 fresh pages: cached reads
#: spent 3× the disk time in page faults (0.5 GB/s, 1.2–1.4 with this). One such buffer per arena stays.
TRIM_THRESHOLD = 2 * 1024 * 1024
_done = False


def bound_allocator(threshold: int) -> bool:
    """Pin glibc's mmap threshold and its trim threshold (process-wide, once). Returns whether it took
    effect."""
    global _done
    if _done:
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1
        if ok:
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok

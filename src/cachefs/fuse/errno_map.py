"""Exceptions → errno for FUSE replies: the one table, used once, at the edge."""

from __future__ import annotations

import errno
import logging

from cachefs.base.errors import (
    AccessDeniedError,
    CacheFSError,
    CacheFullError,
    CorruptBlockError,
    ObjectNotFoundError,
    OriginError,
    ReadOnlyError,
    StaleObjectError,
)

log = logging.getLogger("cachefs.fuse")

#: First match wins. Origin trouble on an uncached read is EIO (the reader cannot do better than retry
#: later); a pinned object that changed at the origin is ESTALE; writes are EROFS.
ERRNO_TABLE: list[tuple[type[BaseException], int]] = [
    (ObjectNotFoundError, errno.ENOENT),
    (FileNotFoundError, errno.ENOENT),
    (IsADirectoryError, errno.EISDIR),
    (NotADirectoryError, errno.ENOTDIR),
    (StaleObjectError, errno.ESTALE),
    (ReadOnlyError, errno.EROFS),
    (AccessDeniedError, errno.EACCES),
    (CacheFullError, errno.ENOSPC),
    (CorruptBlockError, errno.EIO),
    (OriginError, errno.EIO),
    (TimeoutError, errno.EIO),
    (InterruptedError, errno.EINTR),
]


def to_errno(exc: BaseException, what: str = "") -> int:
    """The errno for ``exc``; unknown exceptions are EIO and logged with their traceback."""
    for cls, code in ERRNO_TABLE:
        if isinstance(exc, cls):
            if code == errno.EIO:
                log.warning("%s: %s", what, exc)
            return code
    if isinstance(exc, CacheFSError) and exc.errno:
        return exc.errno
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    log.error("%s: unexpected error", what, exc_info=exc)
    return errno.EIO

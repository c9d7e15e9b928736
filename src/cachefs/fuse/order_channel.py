"""Publishing a read order through a mount (for a process that sees the mount but not the node's cache
directory: a pod reading through a CSI volume).

The process writes the order to a file of its own and asks the mount's root for the extended attribute
``user.cachefs.publish:<absolute path of that file>`` (``cachefs.publish_order(mountpoint, ...)`` does this). The
daemon opens the file through the caller's own root (``/proc/<pid>/root``), takes it only if the caller owns it
(its uid, as the kernel reports it; the last component is not followed if a symlink) and it is a regular file of at
most :data:`MAX_ORDER_FILE` bytes, and publishes it for the mount's dataset (cachefs.index.orders). The
attribute's value is what it published. Such an order can do no more than the caller's own reads could: name files
of the dataset it reads, to be fetched ahead within the lookahead budget.
"""

from __future__ import annotations

import contextvars
import errno
import json
import os
import stat

from cachefs.base.errors import CacheFSError
from cachefs.index.orders import write_order
from cachefs.manifest.dataset import Dataset
from cachefs.prefetch.orders import relative_paths

__all__ = ["CALLER", "MAX_ORDER_FILE", "PUBLISH_PREFIX", "publish_from_caller"]

#: The extended attribute name's prefix; the rest is the order file's absolute path in the caller's file system.
PUBLISH_PREFIX = b"user.cachefs.publish:"
#: The largest order file taken.
MAX_ORDER_FILE = 1 << 30
#: (uid, gid, pid) of the request being answered, as the kernel gave them (set by the session per request).
CALLER: contextvars.ContextVar[tuple[int, int, int]] = contextvars.ContextVar("fuse_caller", default=(0, 0, 0))


def publish_from_caller(cache_dir: str, ds: Dataset, name: bytes) -> bytes:
    """Answer ``user.cachefs.publish:<path>``: the order published, as ``published N files as PUBLISHER``."""
    uid, _gid, pid = CALLER.get()
    path = name[len(PUBLISH_PREFIX):].decode("utf-8", "surrogateescape")
    if not path.startswith("/") or "\0" in path:
        raise OSError(errno.EINVAL, "give the order file's absolute path")
    if pid <= 0:
        raise OSError(errno.EPERM, "the caller's process is not visible to the mount's daemon")
    try:
        fd = os.open(f"/proc/{pid}/root{path}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(exc.errno or errno.EACCES, f"order file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            raise OSError(errno.EACCES, f"order file {path}: not a regular file of the caller's")
        if st.st_size > MAX_ORDER_FILE:
            raise OSError(errno.EFBIG, f"order file {path}: over {MAX_ORDER_FILE} bytes")
        raw = f.read(MAX_ORDER_FILE + 1)
    try:
        doc = json.loads(raw)
        paths, epoch, publisher = doc["paths"], doc.get("epoch"), str(doc.get("publisher") or f"pid-{pid}")
        written = write_order(cache_dir, ds.ref.id, ds.ref.url, relative_paths(paths, [ds.ref.url]),
                              epoch=int(epoch) if epoch is not None else None, publisher=publisher)
    except CacheFSError as exc:
        raise OSError(errno.EINVAL, str(exc)) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise OSError(errno.EINVAL, f"order file {path}: not an order ({exc})") from None
    return f"published {len(paths)} files as {os.path.basename(written)[:-5]}".encode()

"""Files of a writable volume for in-process writers (the fsspec protocol with ``writable``): the same volume,
queue and upload as a writable mount, without FUSE.

A process's volume is its own (``session`` = the process), so several processes of a job write at once; each
drains its queue when it exits (up to ``checkpoint.stall_timeout``), and what is left stays staged on the node
for ``cachefs sync URL`` to finish.
"""

from __future__ import annotations

import atexit
import functools
import io
import logging
import os
import shutil
import threading
import time
import uuid
from typing import ClassVar

from cachefs.base.aio import get_loop, run_sync
from cachefs.base.config import Config
from cachefs.base.errors import InvalidURLError
from cachefs.write import remote
from cachefs.write.opening import open_volume
from cachefs.write.services import NodeServices
from cachefs.write.volume import WritableVolume

__all__ = ["ProcessVolumes", "StagedFile", "VolumeFiles"]

#: Writes are buffered this much in the writer's process: torch.save and friends write in small pieces.
BUFFER = 4 * 1024 * 1024

log = logging.getLogger(__name__)


class StagedFile(io.RawIOBase):
    """A volume file open for writing (and reading back): durable and queued at close."""

    def __init__(self, volume: WritableVolume, rel: str, mode: str) -> None:
        super().__init__()
        self.volume, self.rel, self.mode = volume, rel, mode
        path = volume.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        truncate = "w" in mode
        if "x" in mode and os.path.lexists(path):
            raise FileExistsError(17, "File exists", rel)
        if os.path.lexists(path):
            volume.open_for_write(rel, truncate=truncate)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if truncate else 0) | os.O_CLOEXEC, 0o644)
        self.inode = os.fstat(self.fd).st_ino
        volume.before_write(self.inode, rel, 0)  # (created: uploaded even if nothing is written)
        self.pos = os.fstat(self.fd).st_size if "a" in mode else 0

    def readable(self) -> bool:
        return "+" in self.mode

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self.pos = offset
        elif whence == io.SEEK_CUR:
            self.pos += offset
        else:
            self.pos = os.fstat(self.fd).st_size + offset
        if self.pos < 0:
            raise ValueError("negative seek position")
        return self.pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.volume.before_write(self.inode, self.rel, len(view))
        n = os.pwrite(self.fd, view, self.pos)
        self.pos += n
        return n

    def readinto(self, buffer) -> int:
        data = os.pread(self.fd, len(buffer), self.pos)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else size
        self.volume.before_write(self.inode, self.rel, 0)
        os.ftruncate(self.fd, size)
        return size

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.volume.closed(self.rel, self.fd)
        finally:
            os.close(self.fd)
            super().close()


class ProcessVolumes:
    """This process's volumes, one per root URL (``s3://bucket`` unless a ``volume`` URL is given), shared by every
    filesystem object of the process on the same cache directory (:meth:`of_process`)."""

    _of_process: ClassVar[dict[tuple[int, str], ProcessVolumes]] = {}
    _of_process_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def of_process(cls, config: Config, **kw) -> ProcessVolumes:
        key = (os.getpid(), config.cache.dir)
        with cls._of_process_lock:
            found = cls._of_process.get(key)
            if found is None:
                found = cls._of_process[key] = cls(config, **kw)
            return found

    def __init__(self, config: Config, *, services: NodeServices, storage_options: dict | None = None) -> None:
        self.config, self.services = config, services
        self.storage_options = storage_options
        self._volumes: dict[str, WritableVolume] = {}
        self._lock = threading.Lock()
        self._session = f"process:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        get_loop()
        # The drain at exit needs the loop and the default executor (the uploads read snapshots in threads): it runs
        # with threading's exit hooks, which run before the executor refuses new work and before atexit's, last
        # registered first. (A private hook of the standard library; plain atexit where it is missing.)
        getattr(threading, "_register_atexit", atexit.register)(self.close)

    def volume(self, root: str) -> WritableVolume:
        with self._lock:
            v = self._volumes.get(root)
            if v is None:
                v = open_volume(self.config, root, session=self._session, services=self.services,
                                storage_options=self.storage_options, pid=os.getpid())
                run_sync(v.start(list_origin=False))
                self._volumes[root] = v
            return v

    def close(self, timeout: float | None = None) -> None:
        """Wait (up to ``checkpoint.stall_timeout``) until everything closed is on the origin, then let go of the
        volumes; an emptied one is removed, one with entries left stays for ``cachefs sync``."""
        with self._lock:
            volumes, self._volumes = list(self._volumes.values()), {}
        deadline = time.monotonic() + (self.config.checkpoint.stall_timeout if timeout is None else timeout)
        for v in volumes:
            v.wait_until(functools.partial(_emptied, v), timeout=max(0.0, deadline - time.monotonic()))
            left = len(v.queue.pending())
            run_sync(v.stop())
            if left:
                log.warning("%s: %d uploads did not finish before this process ended; `cachefs sync %s` finishes "
                            "them", v.url, left, v.url)
            elif not v.queue.failed:
                shutil.rmtree(v.dir, ignore_errors=True)


def _split_root(url: str, volume_url: str | None) -> tuple[str, str]:
    """(the volume's root URL, the key under it) for an object URL."""
    if volume_url:
        root = volume_url.rstrip("/")
        if not url.startswith(root + "/"):
            raise InvalidURLError(f"{url} is outside the writable volume {root}")
        return root, url[len(root) + 1:]
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    if not key:
        raise InvalidURLError(f"{url}: not an object (s3://bucket/key)")
    return f"{scheme}://{bucket}", key.rstrip("/")


class VolumeFiles:
    """What the fsspec protocol does with ``writable``: URLs in, this process's volumes underneath."""

    def __init__(self, volumes: ProcessVolumes, volume_url: str | None = None) -> None:
        self.volumes, self.volume_url = volumes, volume_url

    def _where(self, url: str) -> tuple[WritableVolume, str]:
        root, rel = _split_root(url, self.volume_url)
        return self.volumes.volume(root), rel

    def open(self, url: str, mode: str) -> io.BufferedIOBase:
        volume, rel = self._where(url)
        raw = StagedFile(volume, rel, mode)
        if "+" in mode:
            return io.BufferedRandom(raw, buffer_size=BUFFER)
        return io.BufferedWriter(raw, buffer_size=BUFFER)

    def local(self, url: str) -> str | None:
        """The tree file holding ``url``'s bytes, if this process wrote it (None: read it from the origin)."""
        try:
            volume, rel = self._where(url)
        except InvalidURLError:
            return None
        path = volume.path(rel)
        if os.path.isfile(path) and remote.xattr(path, remote.REMOTE) is None:
            return path
        return None

    def local_dir(self, url: str) -> str | None:
        try:
            volume, rel = self._where(url)
        except InvalidURLError:
            return None
        path = volume.path(rel)
        return path if os.path.isdir(path) else None

    def _there(self, volume: WritableVolume, url: str, recursive: bool) -> dict[str, int]:
        """The origin's objects at ``url`` (key "" → size) and, if ``recursive``, under it (key → size)."""

        async def listing() -> dict[str, int]:
            out: dict[str, int] = {}
            try:
                out[""] = (await volume.source.stat(url)).size
            except FileNotFoundError:
                pass
            if recursive:
                try:
                    async for batch in volume.source.list_tree(url):
                        out.update({e.path: e.size for e in batch if not remote.is_internal(e.path)})
                except FileNotFoundError:
                    pass
            return out

        return run_sync(listing())

    def remove(self, url: str, *, recursive: bool = False) -> None:
        """Delete ``url`` (with ``recursive``, everything under it): what this process wrote, and the origin's
        objects, in order after what was closed before."""
        volume, rel = self._where(url)
        keys_there = list(self._there(volume, url, recursive))
        if not keys_there and not os.path.lexists(volume.path(rel)):
            raise FileNotFoundError(2, "No such file or directory", url)
        path = volume.path(rel)
        if os.path.isdir(path):
            for dirpath, _dirs, files in os.walk(path, topdown=False):
                for name in files:
                    volume.unlink(os.path.relpath(os.path.join(dirpath, name), volume.tree))
                os.rmdir(dirpath)
        elif os.path.lexists(path):
            volume.unlink(rel)
        for key in keys_there:
            full = f"{rel}/{key}" if key else rel
            if not os.path.lexists(volume.path(full)):
                volume.remove_remote(full)

    def move(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` within one volume: what this process wrote is renamed in its tree (re-keyed
        if not uploaded yet), the origin's objects at or under it copied and deleted."""
        volume, srel = self._where(src)
        dvolume, drel = self._where(dst)
        if dvolume is not volume:
            raise InvalidURLError(f"{src} → {dst}: a rename stays within one volume (bucket)")
        if os.path.lexists(volume.path(srel)):
            os.makedirs(os.path.dirname(volume.path(drel)), exist_ok=True)
            volume.rename(srel, drel)
            return
        sizes_there = self._there(volume, src, True)
        if not sizes_there:
            raise FileNotFoundError(2, "No such file or directory", src)
        for key, size in sizes_there.items():
            volume.move_remote(f"{srel}/{key}" if key else srel, f"{drel}/{key}" if key else drel, size)

    def mkdir(self, url: str) -> None:
        volume, rel = self._where(url)
        os.makedirs(volume.path(rel), exist_ok=True)


def _emptied(volume: WritableVolume) -> bool:
    return not volume.queue.entries

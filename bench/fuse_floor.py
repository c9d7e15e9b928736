"""The least a FUSE daemon in Python does for a walk: our request loop (``cachefs.fuse.request_loop``, the same
threads, decoding and replies as a cachefs mount) over a tree that is arithmetic, not a manifest. ``dirs``
directories ``d000000`` … of ``per_dir`` empty files ``f0000000000.bin`` …, named as the synthetic S3 endpoint
names them; every LOOKUP, GETATTR and READDIRPLUS is answered from the name alone (no index, no inode table, no
memory per inode). What a walk through it costs is the kernel's round trips plus our protocol layer in Python on
this machine: the bound a cachefs walk with its manifest local is measured against (bench/scale_bench.py).

    python -m bench.scale_bench --sizes 1000000 --systems cachefs   # measures it beside a cachefs mount

:class:`FileTree` is the same for reads: files of given sizes, their bytes in memory (bench/uring_bench.py's floor
for warm small files).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from bench.fuse_bench import Mount
from cachefs.fuse import kernel_abi as abi
from cachefs.fuse.kernel_abi import InitFlag, Op, OpenFlag
from cachefs.fuse.request_loop import RequestLoop

TIMEOUT = 3600.0  # (as a cachefs mount's entries and attributes: a frozen tree)
ROOT = 1


class ArithmeticTree(RequestLoop):
    """A read-only tree of ``dirs`` × ``per_dir`` empty files, inode numbers computed from names."""

    def __init__(self, fd: int, dirs: int, per_dir: int, workers: int = 4) -> None:
        super().__init__(fd, workers=workers, timeout=TIMEOUT)
        self.dirs, self.per_dir = dirs, per_dir
        self.ops.update({Op.LOOKUP: self.lookup, Op.GETATTR: self.getattr, Op.OPENDIR: self.opendir,
                         Op.READDIRPLUS: self.readdirplus, Op.RELEASEDIR: self.empty, Op.STATFS: self.statfs,
                         Op.ACCESS: self.empty})

    def init_wants(self) -> int:
        return int(InitFlag.ASYNC_READ | InitFlag.PARALLEL_DIROPS | InitFlag.MAX_PAGES | InitFlag.DO_READDIRPLUS
                   | InitFlag.INIT_EXT)

    def initialized(self, agreed: int) -> int:
        self.mode = "userspace"
        return 0

    # -- the tree -------------------------------------------------------------------------------------------------
    def _file_ino(self, d: int, f: int) -> int:
        return 2 + self.dirs + d * self.per_dir + f

    def _attr(self, ino: int) -> bytes:
        is_dir = ino < 2 + self.dirs
        return abi.pack_attr(ino, 0, (0o40555 if is_dir else 0o100444), 0, 2 if is_dir else 1)

    def lookup(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        name = bytes(body).split(b"\0", 1)[0]
        try:
            if nodeid == ROOT and name.startswith(b"d"):
                d = int(name[1:])
                ino = 2 + d if d < self.dirs else 0
            elif 2 <= nodeid < 2 + self.dirs and name.startswith(b"f") and name.endswith(b".bin"):
                d, i = nodeid - 2, int(name[1:-4])
                ino = self._file_ino(d, i - d * self.per_dir) if d * self.per_dir <= i < (d + 1) * self.per_dir else 0
            else:
                ino = 0
        except ValueError:
            ino = 0
        if not ino:
            raise OSError(errno.ENOENT, "no such entry")
        return abi.pack_entry(ino, self._attr(ino), TIMEOUT, TIMEOUT)

    def getattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return abi.pack_attr_out(self._attr(nodeid), TIMEOUT)

    def opendir(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return abi.OPEN_OUT.pack(nodeid, OpenFlag.CACHE_DIR | OpenFlag.KEEP_CACHE, 0)

    def readdirplus(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        _fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        if nodeid == ROOT:
            count = self.dirs
            names = [f"d{d:06d}".encode() for d in range(count)]
            first_ino = 2
        else:
            d = nodeid - 2
            count = self.per_dir
            names = [f"f{d * self.per_dir + f:010d}.bin".encode() for f in range(count)]
            first_ino = self._file_ino(d, 0)
        out, used = bytearray(), 0
        for i in range(offset, count + 2):
            name = b"." * (i + 1) if i < 2 else names[i - 2]
            used += abi.dirent_size(name, True)
            if used > size:
                break
            if i < 2:
                out += abi.pack_entry(0, bytes(abi.ATTR.size), 0, 0)
                out += abi.pack_dirent(nodeid, i + 1, name, abi.DT_DIR)
            else:
                ino = first_ino + i - 2
                out += abi.pack_entry(ino, self._attr(ino), TIMEOUT, TIMEOUT)
                out += abi.pack_dirent(ino, i + 1, name, abi.DT_DIR if nodeid == ROOT else abi.DT_REG)
        return bytes(out)

    def statfs(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return abi.KSTATFS.pack(0, 0, 0, self.dirs * (self.per_dir + 1), 0, 4096, 255, 4096)

    def empty(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return b""


class FileTree(RequestLoop):
    """A read-only tree of the files ``sizes`` names (``dir/name``: one level of directories): what a daemon must do
    to serve a small file (LOOKUP, OPEN, READ, FLUSH, RELEASE) with none of the work of finding it. Its bytes are
    read from the same path under ``source`` (a local copy: the disk reads a cache must do too), or, without one,
    are zeros held in memory."""

    def __init__(self, fd: int, sizes: dict[str, int], workers: int = 4, source: str = "") -> None:
        super().__init__(fd, workers=workers, timeout=TIMEOUT)
        dirs = sorted({rel.split("/", 1)[0] for rel in sizes})
        self.by_name: dict[tuple[int, bytes], int] = {}
        self.attrs: dict[int, bytes] = {ROOT: abi.pack_attr(ROOT, 0, 0o40555, 0, 2)}
        self.sizes: dict[int, int] = {}
        for i, d in enumerate(dirs):
            ino = 2 + i
            self.by_name[(ROOT, d.encode())] = ino
            self.attrs[ino] = abi.pack_attr(ino, 0, 0o40555, 0, 2)
        next_ino = 2 + len(dirs)
        self.paths: dict[int, str] = {}
        for rel, size in sorted(sizes.items()):
            d, name = rel.split("/", 1)
            self.by_name[(self.by_name[(ROOT, d.encode())], name.encode())] = next_ino
            self.attrs[next_ino] = abi.pack_attr(next_ino, size, 0o100444, 0, 1)
            self.sizes[next_ino] = size
            if source:
                self.paths[next_ino] = os.path.join(source, rel)
            next_ino += 1
        self.zeros = bytes(max(sizes.values(), default=0))
        self.ops.update({Op.LOOKUP: self.lookup, Op.GETATTR: self.getattr, Op.OPEN: self.open, Op.READ: self.read,
                         Op.FLUSH: self.empty, Op.RELEASE: self.release, Op.STATFS: self.statfs,
                         Op.ACCESS: self.empty})

    def init_wants(self) -> int:
        return int(InitFlag.ASYNC_READ | InitFlag.PARALLEL_DIROPS | InitFlag.MAX_PAGES | InitFlag.INIT_EXT)

    def initialized(self, agreed: int) -> int:
        self.mode = "userspace"
        return 0

    def lookup(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        ino = self.by_name.get((nodeid, bytes(body).split(b"\0", 1)[0]))
        if ino is None:
            raise OSError(errno.ENOENT, "no such entry")
        return abi.pack_entry(ino, self.attrs[ino], TIMEOUT, TIMEOUT)

    def getattr(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return abi.pack_attr_out(self.attrs[nodeid], TIMEOUT)

    def open(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh = os.open(self.paths[nodeid], os.O_RDONLY) if nodeid in self.paths else 0
        return abi.OPEN_OUT.pack(fh, OpenFlag.KEEP_CACHE, 0)

    def read(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh, offset, size = abi.READ_IN.unpack_from(body)[:3]
        if fh:
            return os.pread(fh, size, offset)
        end = min(self.sizes.get(nodeid, 0), offset + size)
        return self.zeros[:max(0, end - offset)]

    def release(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        fh = abi.RELEASE_IN.unpack_from(body)[0]
        if fh:
            os.close(fh)
        return b""

    def statfs(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return abi.KSTATFS.pack(0, 0, 0, len(self.attrs), 0, 4096, 255, 4096)

    def empty(self, nodeid: int, unique: int, body: memoryview) -> bytes:
        return b""


def serve(mountpoint: str, dirs: int, per_dir: int) -> None:
    """Mount the arithmetic tree at ``mountpoint`` and serve it until unmounted (root)."""
    from cachefs.fuse.mount import open_and_mount

    fd = open_and_mount(mountpoint, allow_other=False, writable=False)
    try:
        ArithmeticTree(fd, dirs, per_dir).serve()
    finally:
        os.close(fd)


def serve_files(mountpoint: str, sizes_path: str, source: str = "") -> None:
    """Mount :class:`FileTree` of the ``{path: size}`` JSON at ``sizes_path`` (bytes from ``source``) and serve it
    until unmounted (root)."""
    import json

    from cachefs.fuse.mount import open_and_mount

    with open(sizes_path) as f:
        sizes = json.load(f)
    fd = open_and_mount(mountpoint, allow_other=False, writable=False)
    try:
        FileTree(fd, sizes, source=source).serve()
    finally:
        os.close(fd)


def files_floor_mount(mountpoint: str, sizes: dict[str, int], work: str, source: str = "") -> Mount:
    """:class:`FileTree` of ``sizes`` (bytes from ``source``) served by a process of its own, at ``mountpoint``."""
    import json

    path = os.path.join(work, "floor-sizes.json")
    with open(path, "w") as f:
        json.dump(sizes, f)
    return Mount([sys.executable, "-m", "bench.fuse_floor", "--serve", mountpoint, "--files", path,
                  *(["--source", source] if source else [])], mountpoint)


def floor_mount(mountpoint: str, dirs: int, per_dir: int) -> Mount:
    """The arithmetic tree served by a process of its own (as a cachefs daemon is), mounted at ``mountpoint``."""
    return Mount([sys.executable, "-m", "bench.fuse_floor", "--serve", mountpoint, "--dirs", str(dirs), "--per-dir",
                  str(per_dir)], mountpoint)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dirs", type=int, default=1000)
    p.add_argument("--per-dir", type=int, default=1000)
    p.add_argument("--serve", metavar="MOUNTPOINT", required=True, help="mount the tree there and serve it")
    p.add_argument("--files", metavar="SIZES_JSON", help="instead: the files a {path: size} JSON names (FileTree)")
    p.add_argument("--source", default="", help="with --files: read their bytes from this directory")
    args = p.parse_args()
    if args.files:
        serve_files(args.serve, args.files, args.source)
    else:
        serve(args.serve, args.dirs, args.per_dir)


if __name__ == "__main__":
    main()

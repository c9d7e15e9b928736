"""A directory is read a page at a time (issue 45): an open directory of any size holds one page of its children,
and a directory listed from the origin is written down page by page as the LIST pages come."""

from __future__ import annotations

import asyncio
import bisect

import pytest

from cachefs.base.types import DatasetRef, Entry
from cachefs.fuse import kernel_abi as abi
from cachefs.fuse import tree
from cachefs.fuse.tree import DIR_PAGE, DirPages, TreeReplies
from cachefs.index import Index
from cachefs.manifest.lazy import ProvisionalTree


class _Tree:
    """A directory of ``n`` files read the way CacheFS.listdir_page reads the manifest; counts the reads and the
    largest page handed out."""

    def __init__(self, n: int) -> None:
        self.names = sorted(f"f{i:07d}" for i in range(n))
        self.reads = 0
        self.largest = 0
        self.journal = None

    def listdir_page(self, ino: int, after: str | None, limit: int) -> list[Entry]:
        self.reads += 1
        i = 0 if after is None else bisect.bisect_right(self.names, after)
        page = [Entry(f"flat/{n}", 1, "v", 0.0) for n in self.names[i:i + limit]]
        self.largest = max(self.largest, len(page))
        return page


@pytest.mark.parametrize("n", [0, 1, DIR_PAGE - 1, DIR_PAGE, DIR_PAGE + 1, 5 * DIR_PAGE + 17])
def test_children_in_order_one_page_held_one_read_per_page(n):
    fs = _Tree(n)
    pages = DirPages(fs, 2)
    got = []
    while (child := pages.child(len(got))) is not None:
        got.append(child.name)
    assert got == fs.names
    assert fs.largest <= DIR_PAGE
    assert fs.reads == n // DIR_PAGE + 1  # (the last read is the short page that says the directory ends)
    assert pages.child(n + 5) is None


def test_an_offset_behind_the_page_reads_again_from_the_first():
    fs = _Tree(3 * DIR_PAGE)
    pages = DirPages(fs, 2)
    assert pages.child(2 * DIR_PAGE + 3).name == fs.names[2 * DIR_PAGE + 3]
    assert pages.child(7).name == fs.names[7]  # a rewinddir / seekdir back
    assert pages.child(DIR_PAGE + 1).name == fs.names[DIR_PAGE + 1]


def _names(reply: bytes) -> list[tuple[int, str]]:
    """(d_off, name) of each dirent of a READDIR answer."""
    out, at = [], 0
    while at < len(reply):
        _ino, off, namelen, _type = abi.DIRENT_HEAD.unpack_from(reply, at)
        name = reply[at + abi.DIRENT_HEAD.size:at + abi.DIRENT_HEAD.size + namelen]
        out.append((off, name.decode()))
        at += abi.dirent_size(name)
    return out


def test_readdir_answers_resume_at_the_kernels_offsets():
    """READDIR as the kernel sends it: each request at the d_off of the last entry it took, answers of one page
    of memory; every name exactly once, "." and ".." first."""
    n = 3 * DIR_PAGE + 5
    fs = _Tree(n)
    replies = TreeReplies.__new__(TreeReplies)  # (only the directory handles: no mount behind it)
    replies.fs, replies._lock, replies._dirs, replies._next_dir = fs, tree.threading.Lock(), {}, 1
    fh = abi.OPEN_OUT.unpack_from(replies.opendir(2, 0, memoryview(b"")))[0]
    seen, offset = [], 0
    while True:
        got = _names(replies.readdir(2, 0, memoryview(abi.READ_IN.pack(fh, offset, 4096, 0, 0, 0, 0))))
        if not got:
            break
        seen += [name for _, name in got]
        offset = got[-1][0]
    assert seen == [".", "..", *fs.names]
    assert fs.largest <= DIR_PAGE
    replies.releasedir(2, 0, memoryview(abi.RELEASE_IN.pack(fh, 0, 0, 0)))
    assert replies._dirs == {}


class _PagedSource:
    """Lists one directory in ``pages`` pages; before handing out each page after the first, checks that the
    previous one is already in the manifest (what keeps a directory of millions to one page of memory)."""

    lists_directories = True

    def __init__(self, store_names, pages: int, per_page: int) -> None:
        self.store_names, self.pages, self.per_page = store_names, pages, per_page
        self.written_before_next: list[bool] = []

    async def list_directory(self, root_url: str, path: str):
        for p in range(self.pages):
            if p:
                want = {f"flat/f{(p - 1) * self.per_page + i:06d}" for i in range(self.per_page)}
                self.written_before_next.append(want <= set(self.store_names()))
            yield [Entry(f"flat/f{p * self.per_page + i:06d}", 1, "v", 0.0) for i in range(self.per_page)], []


def test_a_directory_listed_on_demand_is_written_page_by_page(tmp_path):
    index = Index(str(tmp_path))
    ref = DatasetRef.from_url("s3://bucket/data")
    loop = asyncio.new_event_loop()
    try:
        lazy = ProvisionalTree(index, None, ref, loop)  # type: ignore[arg-type]
        source = _PagedSource(lambda: [e.path for e in lazy.store.listdir(ref.id, lazy.version, "flat")], 4, 50)
        lazy.source = source
        loop.run_until_complete(lazy._list("flat"))
        assert source.written_before_next == [True, True, True]
        assert len(lazy.listdir_page(ref.id, lazy.version, "flat", None, 1000)) == 200
        assert [e.name for e in lazy.listdir_page(ref.id, lazy.version, "flat", "f000099", 3)] == [
            "f000100", "f000101", "f000102"]
    finally:
        loop.close()


class _Manifest:
    """A dataset whose one directory ``d`` holds ``n`` files, read as Dataset.listdir_page reads the manifest."""

    def __init__(self, n: int) -> None:
        self.names = [f"f{i:07d}" for i in range(n)]
        self.ref, self.version = DatasetRef.from_url("s3://bucket/data"), 1
        self.largest = 0

    def listdir_page(self, parent: str, after: str | None, limit: int) -> list[Entry]:
        first = 0 if after is None else bisect.bisect_right(self.names, after)
        self.largest = max(self.largest, min(limit, len(self.names) - first))
        return [Entry(f"d/{n}", 1, "v", 0.0) for n in self.names[first:first + limit]]


def test_directory_read_ahead_reads_the_next_files_from_where_it_reached():
    """After a miss, the next ``count`` files of the directory; a miss inside what was read ahead asks only for
    the files past it; a miss far away starts afresh. Never more than ``count`` entries are read (no directory is
    held whole)."""
    from cachefs.prefetch.directories import DirectoryAhead

    ds = _Manifest(1_000_000)
    ahead = DirectoryAhead(64)

    def miss(i: int) -> list[int]:
        return [int(e.name[1:]) for e in ahead.after_miss(ds, Entry(f"d/f{i:07d}", 1, "v", 0.0))]

    assert miss(10) == list(range(11, 75))
    assert miss(11) == [75]  # (11..74 read ahead already)
    assert miss(500_000) == list(range(500_001, 500_065))
    assert miss(12) == list(range(13, 77))  # (what was reached is past this miss's span: afresh)
    assert miss(999_999) == [] and miss(999_990) == list(range(999_991, 1_000_000))
    assert ds.largest <= 64

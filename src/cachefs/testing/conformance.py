"""Conformance suites: every :class:`~cachefs.sources.Source`, :class:`~cachefs.store.BlockStore` and
:class:`~cachefs.store.PackStore` implementation gets a test class that subclasses one of these and provides the
fixture it names (tiers: :mod:`cachefs.testing.tier_conformance`; whole-object writes:
:mod:`cachefs.testing.writes_conformance`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from cachefs.base.checksum import block_checksum
from cachefs.base.errors import CorruptBlockError, ObjectNotFoundError, StaleObjectError
from cachefs.formats.pack_file import CORRUPT, Member, read_member, serialize
from cachefs.sources import RetryingSource, RetryPolicy
from cachefs.store import BlockStore


def _run(source, scenario):
    """Run ``scenario(source)`` in one event loop and close the source (its connections belong to the loop)."""

    async def main():
        try:
            return await scenario(source)
        finally:
            await source.close()

    return asyncio.run(main())


async def _list(source, url):
    out = []
    async for batch in source.list_tree(url):
        out.extend(batch)
    return {e.path: e for e in out}


@dataclass
class SourceOrigin:
    """What a ``origin`` fixture of :class:`SourceConformance` returns."""

    source: Any
    root: str
    put: Callable[[str, bytes], Any]
    missing_root: str


class SourceConformance:
    """Subclasses provide a ``origin`` fixture: an object with ``.source`` (a raw Source), ``.root`` (dataset
    URL), ``.put(path, bytes)`` and ``.missing_root`` (a URL under which nothing exists)."""

    FILES: ClassVar[dict[str, bytes]] = {
        "a.txt": b"hello",
        "empty.bin": b"",
        "dir/b.bin": bytes(range(256)) * 300,
        "dir/sub/c d ü.txt": b"unicode and spaces",
    }

    @pytest.fixture
    def populated(self, origin):
        for path, data in self.FILES.items():
            origin.put(path, data)
        return origin

    def _retrying(self, origin):
        return RetryingSource(origin.source, RetryPolicy(3, 0.001, 0.01), 10.0)

    def test_lists_every_file_with_size_and_version(self, populated):
        got = _run(populated.source, lambda src: _list(src, populated.root))
        assert set(got) == set(self.FILES)
        for path, data in self.FILES.items():
            assert got[path].size == len(data)
            assert got[path].version, path
            assert not got[path].is_dir

    def test_lists_one_directory_where_it_can(self, populated):
        if not populated.source.lists_directories:
            pytest.skip("this source lists whole trees only")

        async def whole(src, d):
            files, dirs = [], []
            async for page_files, page_dirs in src.list_directory(populated.root, d):
                files += page_files
                dirs += page_dirs
            return files, dirs

        async def scenario(src):
            return [await whole(src, d) for d in ("", "dir", "dir/sub", "nothing")]

        (root_files, root_dirs), (files, dirs), (sub_files, sub_dirs), (none_files, none_dirs) = _run(
            self._retrying(populated), scenario)
        listed = {e.path: e for e in root_files + files + sub_files}
        assert sorted(e.path for e in root_files) == ["a.txt", "empty.bin"] and root_dirs == ["dir"]
        assert [e.path for e in files] == ["dir/b.bin"] and dirs == ["sub"]
        assert [e.path for e in sub_files] == ["dir/sub/c d ü.txt"] and sub_dirs == []
        assert (none_files, none_dirs) == ([], [])
        for path, data in self.FILES.items():
            assert listed[path].size == len(data) and listed[path].version, path

    def test_reads_exact_ranges(self, populated):
        data = self.FILES["dir/b.bin"]
        url = f"{populated.root}/dir/b.bin"
        ranges = [(0, 1), (0, len(data)), (1000, 1001), (7, 70_000), (len(data) - 3, len(data)), (5, 5)]

        async def scenario(src):
            e = (await _list(src, populated.root))["dir/b.bin"]
            return [await src.read(url, e.version, s, t) for s, t in ranges]

        got = _run(self._retrying(populated), scenario)
        assert got == [data[s:t] for s, t in ranges]

    def test_changed_object_is_stale(self, populated):
        async def scenario(src):
            e = (await _list(src, populated.root))["a.txt"]
            populated.put("a.txt", b"HELLO, changed")
            await src.read(f"{populated.root}/a.txt", e.version, 0, 5)

        with pytest.raises(StaleObjectError):
            _run(self._retrying(populated), scenario)

    def test_object_changed_after_other_reads_is_stale(self, populated):
        """Also once a source has warmed up (S3: GETs signed by cachefs, not botocore's first request)."""
        if not populated.source.verifies_version:
            pytest.skip("this source checks the version on the first read of an object only (docs/SEMANTICS.md)")

        async def scenario(src):
            entries = await _list(src, populated.root)
            for path in ("dir/b.bin", "dir/sub/c d ü.txt", "a.txt"):
                e = entries[path]
                assert await src.read(f"{populated.root}/{path}", e.version, 0, e.size) == self.FILES[path]
            populated.put("a.txt", b"HELLO, changed")
            await src.read(f"{populated.root}/a.txt", entries["a.txt"].version, 0, 5)

        with pytest.raises(StaleObjectError):
            _run(self._retrying(populated), scenario)

    def test_missing_root_is_not_found(self, origin):
        with pytest.raises(ObjectNotFoundError):
            _run(origin.source, lambda src: _list(src, origin.missing_root))

    def test_write_replaces_the_whole_object(self, populated):
        url = f"{populated.root}/written/new.bin"

        async def scenario(src):
            first = await src.write(url, b"x" * 1000)
            second = await src.write(url, b"second version")
            st = await src.stat(url)
            return first, second, st, await src.read(url, second.version, 0, 14)

        first, second, st, data = _run(self._retrying(populated), scenario)
        assert (first.size, second.size, st.size, data) == (1000, 14, 14, b"second version")
        assert second.version == st.version

    def test_stat_matches_listing(self, populated):
        async def scenario(src):
            e = (await _list(src, populated.root))["dir/b.bin"]
            st = await src.stat(f"{populated.root}/dir/b.bin")
            return (st.size, st.version), (e.size, e.version)

        a, b = _run(self._retrying(populated), scenario)
        assert a == b


class BlockStoreConformance:
    """Subclasses provide a ``store`` fixture: a fresh BlockStore with a small block size."""

    KEY = bytes(range(16))

    def _write_all(self, store: BlockStore, data: bytes):
        obj = store.open(self.KEY, "ds", len(data))
        bs = store.block_size
        sums = {}
        for i in range(0, -(-len(data) // bs)):
            block = data[i * bs : (i + 1) * bs]
            obj.write_block(i, block)
            sums[i] = (block_checksum(block), len(block))
        return obj, sums

    def test_write_then_read_any_range(self, store):
        data = os.urandom(store.block_size * 3 + 17)
        obj, sums = self._write_all(store, data)
        for start, end in [(0, len(data)), (1, 2), (store.block_size - 1, store.block_size + 1), (len(data) - 1, len(data))]:
            assert obj.read(start, end, sums) == data[start:end]
        obj.close()

    def test_complete_object_is_one_local_file(self, store):
        data = os.urandom(store.block_size * 2 + 5)
        obj, _ = self._write_all(store, data)
        with open(obj.path, "rb") as f:
            assert f.read() == data
        obj.close()

    def test_corrupt_block_is_detected(self, store):
        data = os.urandom(store.block_size * 2)
        obj, sums = self._write_all(store, data)
        obj.close()
        with open(store.open(self.KEY, "ds", len(data)).path, "r+b") as f:
            f.seek(store.block_size + 10)
            f.write(b"\xff\x00\xff")
        fresh = store.open(self.KEY, "ds", len(data))
        assert fresh.read(0, 10, sums) == data[:10]
        with pytest.raises(CorruptBlockError) as info:
            fresh.read(store.block_size, store.block_size + 20, sums)
        assert info.value.block == 1
        fresh.close()

    def test_held_object_is_not_removed(self, store):
        data = os.urandom(100)
        obj, _ = self._write_all(store, data)
        assert obj.hold() is True
        assert store.try_remove(self.KEY, "ds", lambda: True) is False
        obj.unhold()
        assert store.try_remove(self.KEY, "ds", lambda: True) is True
        again = store.open(self.KEY, "ds", len(data))
        assert again.read(0, 100, {0: (block_checksum(bytes(100)), 100)}) == bytes(100)  # a new, empty file
        again.close()
        obj.close()

    def test_idle_open_object_is_removed_and_still_reads(self, store):
        # A descriptor kept open without a hold (a process's cache of open files) must not stop eviction; it
        # reads on from the unlinked file, and knows the file is no longer the cache's.
        data = os.urandom(store.block_size + 10)
        obj, sums = self._write_all(store, data)
        assert obj.linked() is True
        assert store.try_remove(self.KEY, "ds", lambda: True) is True
        assert obj.linked() is False
        assert obj.hold() is False
        assert obj.read(0, len(data), sums) == data
        obj.close()

    def test_dropped_block_gives_its_space_back(self, store):
        data = os.urandom(store.block_size * 4)
        obj, _ = self._write_all(store, data)
        before = os.stat(obj.path).st_blocks
        obj.drop_block(1)
        obj.drop_block(2)
        assert os.stat(obj.path).st_blocks < before
        obj.close()

    def test_keeping_some_blocks_gives_the_others_space_back_and_old_readers_read_on(self, store):
        bs = store.block_size
        data = os.urandom(bs * 4 + 10)
        obj, sums = self._write_all(store, data)
        assert obj.hold() is True
        assert store.try_keep_only(self.KEY, "ds", lambda: [0, 4], lambda: True) is False  # held: left alone
        obj.unhold()
        before = os.stat(obj.path).st_blocks
        assert store.try_keep_only(self.KEY, "ds", lambda: [0, 4], lambda: False) is False  # vetoed: left alone
        assert os.stat(obj.path).st_blocks == before
        assert store.try_keep_only(self.KEY, "ds", lambda: [0, 4], lambda: True) is True
        assert obj.linked() is False and obj.hold() is False  # the old file is no longer the cache's ...
        assert obj.read(0, len(data), sums) == data  # ... and still whole for whoever had it open
        obj.close()
        kept = store.open(self.KEY, "ds", len(data))
        assert os.stat(kept.path).st_blocks < before
        assert kept.read(0, bs, {0: sums[0]}) == data[:bs]
        assert kept.read(4 * bs, len(data), {4: sums[4]}) == data[4 * bs:]
        with pytest.raises(CorruptBlockError):
            kept.read(bs, 2 * bs, {1: sums[1]})  # not kept: a hole, which never passes as the block
        kept.close()
        assert not [n for n in os.listdir(os.path.dirname(kept.path)) if ".keep." in n]
        assert store.try_keep_only(self.KEY, "ds", list, lambda: True) is True  # nothing to keep: the file goes
        assert not os.path.exists(kept.path)

    def test_remove_can_be_vetoed(self, store):
        obj, _ = self._write_all(store, b"x" * 10)
        obj.close()
        assert store.try_remove(self.KEY, "ds", lambda: False) is False
        assert os.path.exists(store.open(self.KEY, "ds", 10).path)

    def test_disk_usage(self, store):
        total, free = store.disk_usage()
        assert total > 0 and 0 <= free <= total


class PackStoreConformance:
    """Subclasses provide a ``packs`` fixture: a fresh :class:`~cachefs.store.PackStore`."""

    DATASET = "0123456789abcdef"

    @staticmethod
    def _members(n: int = 5) -> list[Member]:
        out = []
        for i in range(n):
            data = os.urandom(100 + 37 * i) if i else b""
            out.append(Member(bytes([i]) * 16, f"d/f{i}.bin", f"v{i}", block_checksum(data), data))
        return out

    def test_every_member_reads_back_verified_where_the_pack_says(self, packs):
        members = self._members()
        written = packs.write(self.DATASET, members)
        fd = packs.open(self.DATASET, written.pack_id)
        assert fd is not None
        try:
            assert os.fstat(fd).st_size == written.size
            for m, (okey, offset, length, checksum) in zip(members, written.members, strict=True):
                assert (okey, length, checksum) == (m.okey, len(m.data), m.checksum)
                assert read_member(fd, offset, length, checksum) == m.data
        finally:
            os.close(fd)
        assert [(d, i) for d, i, _ in packs.files()] == [(self.DATASET, written.pack_id)]

    def test_a_damaged_member_reads_as_corrupt(self, packs):
        members = self._members(3)
        written = packs.write(self.DATASET, members)
        _okey, offset, length, checksum = written.members[2]
        with open(packs.pack_path(self.DATASET, written.pack_id), "r+b") as f:
            f.seek(offset + 1)
            f.write(b"\xff\x00")
        fd = packs.open(self.DATASET, written.pack_id)
        try:
            assert read_member(fd, offset, length, checksum) is CORRUPT
        finally:
            os.close(fd)

    def test_a_pack_filled_in_pieces_is_nameless_until_published(self, packs):
        view, placed = serialize(self._members(4))
        pack_id, tmp, fd = packs.begin(self.DATASET)
        half = len(view) // 2
        packs.write_at(fd, view[half:], half, tmp)
        packs.write_at(fd, view[:half], 0, tmp)
        assert list(packs.files()) == []  # not a pack yet
        packs.publish(self.DATASET, pack_id, tmp, fd)
        assert not os.path.exists(tmp)
        rfd = packs.open(self.DATASET, pack_id)
        try:
            for okey, offset, length, checksum in placed:
                assert read_member(rfd, offset, length, checksum) is not CORRUPT, okey
        finally:
            os.close(rfd)

    def test_an_abandoned_pack_leaves_nothing(self, packs):
        pack_id, tmp, fd = packs.begin(self.DATASET)
        packs.write_at(fd, b"half a pack", 0, tmp)
        packs.abandon(tmp, fd)
        assert not os.path.exists(tmp) and list(packs.files()) == []
        assert packs.open(self.DATASET, pack_id) is None

    def test_a_removed_pack_still_reads_through_an_open_descriptor(self, packs):
        members = self._members(2)
        written = packs.write(self.DATASET, members)
        fd = packs.open(self.DATASET, written.pack_id)
        packs.remove(self.DATASET, written.pack_id)
        packs.remove(self.DATASET, written.pack_id)  # (twice: no error)
        try:
            assert packs.open(self.DATASET, written.pack_id) is None and list(packs.files()) == []
            _okey, offset, length, checksum = written.members[1]
            assert read_member(fd, offset, length, checksum) == members[1].data
        finally:
            os.close(fd)

    def test_clean_removes_dead_writers_temp_files_and_old_unknown_packs_only(self, packs):
        known = packs.write(self.DATASET, self._members(2))
        unknown_old = packs.write(self.DATASET, self._members(2))
        unknown_new = packs.write(self.DATASET, self._members(2))
        old = time.time() - 7 * 24 * 3600
        os.utime(packs.pack_path(self.DATASET, unknown_old.pack_id), (old, old))
        _pack_id, live_tmp, fd = packs.begin(self.DATASET)  # a writer that is alive (this process)
        dead_tmp = packs.pack_path(self.DATASET, 7) + ".999999999.tmp"  # no such process
        with open(dead_tmp, "wb") as f:
            f.write(b"x")
        try:
            removed = packs.clean(lambda ds, pack_id: pack_id == known.pack_id)
            assert removed == 2
            left = {i for _d, i, _p in packs.files()}
            assert left == {known.pack_id, unknown_new.pack_id}
            assert os.path.exists(live_tmp) and not os.path.exists(dead_tmp)
        finally:
            packs.abandon(live_tmp, fd)

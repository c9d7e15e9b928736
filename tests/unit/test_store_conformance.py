import pytest

from cachefs.store import DiskPackStore, DiskStore
from cachefs.testing.conformance import BlockStoreConformance, PackStoreConformance


class TestDiskStore(BlockStoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return DiskStore(str(tmp_path / "cache"), 64 * 1024)

    def test_layout_and_modes(self, store, tmp_path):
        obj = store.open(bytes(16), "0123456789abcdef", 10)
        assert obj.path == str(tmp_path / "cache" / "data" / "0123456789abcdef" / "00" / ("00" * 16))
        import os
        import stat

        assert stat.S_IMODE(os.stat(obj.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(obj.path)).st_mode) == 0o700
        assert os.stat(obj.path).st_size == 10  # sparse, full size from the start
        obj.close()


def test_blocks_larger_than_a_verify_piece_are_verified_whole(tmp_path):
    """A 4 MiB block is verified in 1 MiB reads: every range gets its exact bytes on the first (verifying)
    read, and damage anywhere in the block fails the read of any part of it."""
    import os

    from cachefs.base.checksum import block_checksum
    from cachefs.base.errors import CorruptBlockError
    from cachefs.store.disk import _VERIFY_PIECE

    bs = 4 * _VERIFY_PIECE
    store = DiskStore(str(tmp_path / "cache"), bs)
    data = os.urandom(2 * bs + _VERIFY_PIECE + 123)  # two whole blocks and a short last one
    key = bytes(range(16))
    obj = store.open(key, "ds", len(data))
    sums = {}
    for i in range(3):
        block = data[i * bs:(i + 1) * bs]
        obj.write_block(i, block)
        sums[i] = (block_checksum(block), len(block))
    obj.close()
    ranges = [(0, len(data)), (5, 6), (_VERIFY_PIECE - 1, _VERIFY_PIECE + 1), (bs - 3, bs + 2 * _VERIFY_PIECE + 7),
              (2 * bs + 100, len(data)), (bs, 2 * bs)]
    for start, end in ranges:
        fresh = store.open(key, "ds", len(data))  # nothing verified yet
        assert fresh.read(start, end, sums) == data[start:end]
        assert fresh.read(start, end, sums) == data[start:end]  # verified now: a plain read
        fresh.close()
    with open(obj.path, "r+b") as f:
        f.seek(bs + 3 * _VERIFY_PIECE + 10)  # the last piece of block 1
        f.write(b"\xff\x00\xff")
    fresh = store.open(key, "ds", len(data))
    with pytest.raises(CorruptBlockError) as info:
        fresh.read(bs, bs + 1, sums)
    assert info.value.block == 1
    assert fresh.read(0, 10, sums) == data[:10]
    fresh.close()


class TestDiskPackStore(PackStoreConformance):
    @pytest.fixture
    def packs(self, tmp_path):
        return DiskPackStore(str(tmp_path / "cache"))

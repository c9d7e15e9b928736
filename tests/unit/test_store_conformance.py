import pytest

from cachefs.store import DiskStore
from cachefs.testing.conformance import BlockStoreConformance


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

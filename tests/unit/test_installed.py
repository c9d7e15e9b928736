"""An s3fs left beside an fsspec it does not accept is named in one line, with the fix."""

from __future__ import annotations

from cachefs.sources.installed import s3fs_fsspec_mismatch


def installed(s3fs: str, fsspec: str, needs: str):
    versions = {"s3fs": s3fs, "fsspec": fsspec}
    return dict(version=versions.__getitem__,
                requires=lambda name: ["aiobotocore<4.0.0,>=2.19.0", needs, 'aiohttp!=4.0.0a0; extra == "x"'])


def test_the_installed_pair_is_accepted():
    assert s3fs_fsspec_mismatch() is None


def test_a_pair_that_goes_together():
    assert s3fs_fsspec_mismatch(**installed("2026.9.0", "2026.9.0", "fsspec<2026.9.1,>=2026.9.0")) is None
    assert s3fs_fsspec_mismatch(**installed("2024.6.1", "2024.6.1", "fsspec==2024.6.1.*")) is None


def test_fsspec_moved_alone():
    why = s3fs_fsspec_mismatch(**installed("2026.9.0", "2026.6.0", "fsspec<2026.9.1,>=2026.9.0"))
    assert why is not None
    assert "s3fs 2026.9.0 needs fsspec<2026.9.1,>=2026.9.0 but fsspec 2026.6.0 is installed" in why
    assert "pip install 's3fs==2026.6.0'" in why

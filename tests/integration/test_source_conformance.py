"""Every origin source passes the same conformance suite against a real backend."""

from __future__ import annotations

import os
import time

import pytest

from cachefs.config import load_config
from cachefs.sources import open_raw_origin
from cachefs.testing.conformance import SourceConformance


class _Origin:
    def __init__(self, source, root, put, missing_root):
        self.source, self.root, self.put, self.missing_root = source, root, put, missing_root


class TestS3Source(SourceConformance):
    @pytest.fixture
    def origin(self, s3):
        _, client, bucket = s3
        src = open_raw_origin("s3://x", load_config(env={}, overrides={"cache_dir": "/tmp/unused"}))
        return _Origin(src, f"s3://{bucket}/ds",
                       lambda p, d: client.put_object(Bucket=bucket, Key=f"ds/{p}", Body=d),
                       "s3://no-such-bucket-cachefs/x")


class TestLocalSource(SourceConformance):
    @pytest.fixture
    def origin(self, tmp_path):
        root = tmp_path / "origin"
        root.mkdir()

        def put(p, d):
            path = root / p
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                time.sleep(0.01)  # make sure mtime_ns moves even on coarse clocks
            tmp = path.with_suffix(".tmp~")
            tmp.write_bytes(d)
            os.replace(tmp, path)

        src = open_raw_origin("file:///", load_config(env={}, overrides={"cache_dir": "/tmp/unused"}))
        return _Origin(src, f"file://{root}", put, f"file://{tmp_path}/nothing-here")


class TestMemorySource(SourceConformance):
    """The generic fsspec path, over fsspec's in-memory filesystem."""

    @pytest.fixture
    def origin(self, tmp_path):
        import fsspec

        fs = fsspec.filesystem("memory")
        root = f"/cachefs-test-{tmp_path.name}"

        def put(p, d):
            fs.pipe_file(f"{root}/{p}", d)

        src = open_raw_origin("memory://", load_config(env={}, overrides={"cache_dir": "/tmp/unused"}))
        return _Origin(src, f"memory://{root}", put, f"memory://{root}-missing")

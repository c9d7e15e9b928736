"""S3 timestamps parsed without dateutil give what botocore's own parser gives, in every form S3 sends."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from botocore.utils import parse_timestamp as botocore_parse

from cachefs.sources.s3 import parse_timestamp


@pytest.mark.parametrize("value", [
    "2026-11-30T00:26:40.000Z",  # ListObjectsV2
    "2026-11-30T00:26:40Z",
    "2026-11-30T00:26:40.123456+02:00",
    "Mon, 30 Nov 2026 00:26:40 GMT",  # Last-Modified header (HeadObject, GetObject)
    "1700000000",  # epoch seconds: left to botocore's parser
])
def test_same_instant_as_botocore(value):
    ours = parse_timestamp(value)
    assert ours.tzinfo is not None and ours == botocore_parse(value)


def test_a_timestamp_without_zone_is_utc():
    assert parse_timestamp("2026-11-30T00:26:40") == datetime(2026, 11, 30, 0, 26, 40, tzinfo=UTC)


def test_garbage_is_refused_as_botocore_refuses_it():
    with pytest.raises(ValueError):
        botocore_parse("not a time")
    with pytest.raises(ValueError):
        parse_timestamp("not a time")

"""The benchmarks' fast paths of the test S3 server answer exactly as moto itself does."""

from __future__ import annotations

import pytest

from cachefs.testing.s3server import S3Server

KEYS = ["a", "a/b", "a/b/c d", "a/b+c/ü", "a/bb", "a/c/x", "ab", "b/%41", "b/x&y<z>", "c/d/e/f", "c/d/g",
        *(f"many/d{i % 7}/f{i:04d}" for i in range(230))]


@pytest.fixture(scope="module")
def servers():
    with S3Server() as plain, S3Server(fast=True) as fast:
        for server in (plain, fast):
            client = server.client()
            client.create_bucket(Bucket="lists")
            for i, key in enumerate(KEYS):
                client.put_object(Bucket="lists", Key=key, Body=b"x" * i)
        yield plain.client(), fast.client()


def _pages(client, **kw):
    pages = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="lists", **kw):
        pages.append({
            "keys": [(o["Key"], o["Size"], o["ETag"], o["LastModified"].year) for o in page.get("Contents", [])],
            "prefixes": [p["Prefix"] for p in page.get("CommonPrefixes", [])],
            "count": page["KeyCount"], "truncated": page["IsTruncated"],
        })
    return pages


@pytest.mark.parametrize("kw", [
    {}, {"Prefix": "a"}, {"Prefix": "a/"}, {"Prefix": "a/", "Delimiter": "/"}, {"Delimiter": "/"},
    {"Prefix": "many/", "Delimiter": "/"}, {"Prefix": "many/"}, {"Prefix": "many/", "PaginationConfig": {"PageSize": 7}},
    {"Delimiter": "/", "PaginationConfig": {"PageSize": 2}}, {"Prefix": "c/", "Delimiter": "d"},
    {"StartAfter": "a/b"}, {"Prefix": "a/", "StartAfter": "a/b+c"}, {"Prefix": "b", "StartAfter": "a"},
    {"Prefix": "zz"}, {"Prefix": "b/"},
])
def test_fast_listing_equals_moto(servers, kw) -> None:
    plain, fast = servers
    assert _pages(fast, **kw) == _pages(plain, **kw)


def test_fast_get_equals_moto(servers) -> None:
    plain, fast = servers
    for key in ("a/bb", "b/%41", "b/x&y<z>", "many/d3/f0010"):  # 4 bytes or more
        for rng in (None, "bytes=0-0", "bytes=2-", "bytes=1-3"):
            kw = {"Range": rng} if rng else {}
            a, b = plain.get_object(Bucket="lists", Key=key, **kw), fast.get_object(Bucket="lists", Key=key, **kw)
            assert (a["Body"].read(), a["ETag"], a.get("ContentRange")) == (b["Body"].read(), b["ETag"], b.get("ContentRange"))

"""Our SigV4 GET signing against botocore's own signer, and bucket routes learned from botocore's requests."""

from __future__ import annotations

import datetime
from unittest import mock
from urllib.parse import quote

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from cachefs.sources.s3_get import route_from_request, sigv4_headers

NOW = datetime.datetime(2026, 11, 30, 1, 2, 3, tzinfo=datetime.UTC)


def botocore_authorization(url: str, region: str, creds: Credentials) -> tuple[str, dict]:
    request = AWSRequest(method="GET", url=url, headers={})
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW):
        S3SigV4Auth(creds, "s3", region).add_auth(request)
    return request.headers["Authorization"], dict(request.headers)


@pytest.mark.parametrize("key", ["plain.bin", "dir/sub dir/ü+x (1).jpg", "a~b/c=d&e", "%41literal", "deep/" * 20 + "f"])
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//////////wEaDO+session/token="])
@pytest.mark.parametrize("base", ["http://127.0.0.1:9000/bucket/", "http://bucket.s3.eu-west-1.amazonaws.com/"])
def test_signature_equals_botocore(key: str, token: str | None, base: str) -> None:
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    url = base + quote(key, safe="/~")
    host = url.split("/")[2]
    path = "/" + url.split("/", 3)[3]
    expected, sent = botocore_authorization(url, "eu-west-1", creds)
    keys: dict = {}
    for _ in range(2):  # the second time from the cached signing key
        ours = sigv4_headers(host=host, path=path, region="eu-west-1", access_key=creds.access_key,
                             secret_key=creds.secret_key, token=token, now=NOW.timestamp(), keys=keys)
        assert ours["Authorization"] == expected
        assert ours["x-amz-date"] == sent["X-Amz-Date"]
        assert ours.get("x-amz-security-token") == sent.get("X-Amz-Security-Token")
    assert len(keys) == 1


def test_signature_changes_with_every_input() -> None:
    base = dict(host="h:1", path="/b/k", region="us-east-1", access_key="A", secret_key="S", token=None,
                now=NOW.timestamp())
    first = sigv4_headers(**base)["Authorization"]
    for field, value in [("host", "h:2"), ("path", "/b/j"), ("region", "us-east-2"), ("secret_key", "T"),
                         ("token", "t"), ("now", NOW.timestamp() + 1)]:
        assert sigv4_headers(**{**base, field: value})["Authorization"] != first, field


def test_route_from_path_style_request() -> None:
    key = "dir/ü x.bin"
    auth = ("AWS4-HMAC-SHA256 Credential=AKID/20261130/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-date, Signature=abc")
    route = route_from_request(f"http://127.0.0.1:9000/bucket/{quote(key)}?x-id=GetObject", auth, key)
    assert route is not None
    assert (route.prefix, route.host, route.path_prefix, route.region) == (
        "http://127.0.0.1:9000/bucket/", "127.0.0.1:9000", "/bucket/", "us-east-1")


def test_route_from_virtual_host_and_anonymous_requests() -> None:
    route = route_from_request("https://bucket.s3.eu-west-1.amazonaws.com/k", "", "k")
    assert route is not None and route.region is None and route.path_prefix == "/"
    assert route.host == "bucket.s3.eu-west-1.amazonaws.com"


@pytest.mark.parametrize("url, auth, key", [
    ("http://h/bucket/k", "AWS AKID:signature", "k"),  # SigV2
    ("http://h/bucket/k", "AWS4-HMAC-SHA256 Credential=A/20261130/us-east-1/s3express/aws4_request, S", "k"),
    ("http://h/bucket/other", "", "k"),  # URL not prefix + key
    ("http://h/bucket/xk", "", "k"),
])
def test_route_refused_for_what_we_do_not_sign(url: str, auth: str, key: str) -> None:
    assert route_from_request(url, auth, key) is None

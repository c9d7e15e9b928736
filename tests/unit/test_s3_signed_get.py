"""Our SigV4 GET signing against botocore's own signer, bucket routes learned from botocore's requests, and
listing pages read the way botocore reads them."""

from __future__ import annotations

import datetime
from unittest import mock
from urllib.parse import quote

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from cachefs.sources.s3_get import (
    list_query,
    parse_list_page,
    route_from_list_request,
    route_from_request,
    sigv4_headers,
)

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


@pytest.mark.parametrize("prefix, delimiter, token", [
    ("", "/", None),
    ("ds/sub dir/ü+x&y=z/", "", "1/Tok+en=="),
    ("ds/~a*b'(c)!/", "/", None),
])
@pytest.mark.parametrize("base", ["http://127.0.0.1:9000/bucket", "http://bucket.s3.eu-west-1.amazonaws.com/"])
def test_listing_signature_equals_botocore(prefix: str, delimiter: str, token: str | None, base: str) -> None:
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session")
    query = list_query(prefix, delimiter, token)
    url = f"{base}?{query}"
    expected, _ = botocore_authorization(url, "eu-west-1", creds)
    host, path = base.split("/")[2], "/" + base.split("/", 3)[3]
    ours = sigv4_headers(host=host, path=path, region="eu-west-1", access_key=creds.access_key,
                         secret_key=creds.secret_key, token=creds.token, now=NOW.timestamp(), query=query)
    assert ours["Authorization"] == expected
    assert "encoding-type=url" in query and "list-type=2" in query


def test_listing_route_from_path_style_and_virtual_host_requests() -> None:
    auth = ("AWS4-HMAC-SHA256 Credential=AKID/20261130/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-date, Signature=abc")
    route = route_from_list_request("http://127.0.0.1:9000/bucket?list-type=2&prefix=ds%2F", auth, "bucket")
    assert route is not None
    assert (route.prefix, route.host, route.path_prefix, route.region) == (
        "http://127.0.0.1:9000/bucket", "127.0.0.1:9000", "/bucket", "us-east-1")
    virtual = route_from_list_request("https://bucket.s3.amazonaws.com/?list-type=2", "", "bucket")
    assert virtual is not None and virtual.path_prefix == "/" and virtual.region is None
    assert route_from_list_request("http://h/other?list-type=2", auth, "bucket") is None
    assert route_from_list_request("http://h/bucket?list-type=2", "AWS AKID:sig", "bucket") is None


def _page(contents: str, *, ns: bool = True, extra: str = "") -> bytes:
    xmlns = ' xmlns="http://s3.amazonaws.com/doc/2006-03-01/"' if ns else ""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult{xmlns}>\n  <Name>b</Name>\n'
            f"  {contents}\n  {extra}\n</ListBucketResult>").encode()


def test_a_listing_page_reads_as_botocore_returns_it() -> None:
    body = _page("""<IsTruncated>true</IsTruncated>
  <Contents>
    <Key>ds/a+b%2Bc%20d%C3%BC%26.txt</Key>
    <LastModified>2026-11-30T01:02:03.000Z</LastModified>
    <ETag>&quot;0123abcd&quot;</ETag>
    <Size>12345</Size>
    <StorageClass>STANDARD</StorageClass>
  </Contents>
  <Contents><Size>0</Size><Key>ds/empty</Key><ETag>"e-2"</ETag><LastModified>t2</LastModified></Contents>
  <CommonPrefixes><Prefix>ds/sub%20dir/</Prefix></CommonPrefixes>
  <EncodingType>url</EncodingType>
  <NextContinuationToken>1/tok+en==</NextContinuationToken>""")
    page = parse_list_page(body, lambda t: f"parsed {t}")
    assert page == {
        "Contents": [
            {"Key": "ds/a b+c dü&.txt", "Size": 12345, "ETag": '"0123abcd"',
             "LastModified": "parsed 2026-11-30T01:02:03.000Z"},
            {"Key": "ds/empty", "Size": 0, "ETag": '"e-2"', "LastModified": "parsed t2"},
        ],
        "CommonPrefixes": [{"Prefix": "ds/sub dir/"}],
        "IsTruncated": True,
        "NextContinuationToken": "1/tok+en==",
    }


def test_a_listing_page_without_url_encoding_or_namespace_keeps_its_keys() -> None:
    body = _page("<IsTruncated>false</IsTruncated><Contents><Key>a+b%41 &amp;&lt;</Key><Size>1</Size>"
                 "<ETag>x</ETag><LastModified>t</LastModified></Contents>", ns=False)
    page = parse_list_page(body, str)
    assert page is not None and page["Contents"][0]["Key"] == "a+b%41 &<"
    assert page["IsTruncated"] is False and "NextContinuationToken" not in page


@pytest.mark.parametrize("body", [
    b"not xml",
    b"<Error><Code>AccessDenied</Code><Message>no</Message></Error>",
    _page("<IsTruncated>true</IsTruncated>"),  # truncated without a token: no way on
    _page("<IsTruncated>false</IsTruncated><Contents><Key>k</Key><Size>big</Size><ETag>x</ETag>"
          "<LastModified>t</LastModified></Contents>"),
    _page("<IsTruncated>false</IsTruncated><Contents><Key>k</Key><ETag>x</ETag></Contents>"),  # no size
])
def test_a_listing_answer_we_cannot_read_goes_to_botocore(body: bytes) -> None:
    assert parse_list_page(body, str) is None

"""Every parser that reads what others send, fuzzed (Hypothesis): the extender's request decoding, the S3 listing
page parser, our HTTP/1.1 response reader, and what a user types (dataset URLs, include/exclude globs, YAML
config). Bad input gets the parser's own clear error, never another exception, a hang or a wrong result.

The examples per target are bounded for CI (the ``ci`` profile); ``HYPOTHESIS_PROFILE=long`` runs many more
(bench/README.md). Seeds are real captures: a kube-scheduler ExtenderArgs body, a moto ListObjectsV2 page, an S3
GET response head."""

from __future__ import annotations

import asyncio
import io
import json
import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20_000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
                    max_leaves=30)

# -- the extender's requests ---------------------------------------------------------------------------------
EXTENDER_ARGS = json.dumps({
    "Pod": {"metadata": {"name": "train-0", "namespace": "ml", "uid": "0d3a", "labels": {},
                         "annotations": {"cachefs.io/datasets": "s3://bucket/imagenet"}},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}},
    "Nodes": {"metadata": {}, "items": [{"metadata": {"name": "a", "resourceVersion": "5", "labels": {}},
                                         "status": {"allocatable": {"nvidia.com/gpu": "8"}}}]},
    "NodeNames": None}).encode()


def _extender():
    from scheduler_hints.extender import Extender
    from scheduler_hints.extender_wire import ArgsDecoder

    ext = Extender()
    return ext, ArgsDecoder(ext.node_cache.nodes.get)


def _answer(ext, decoder, verb: str, raw: bytes):
    """What the HTTP handler does with a body: decode, then the verb; only the errors it turns into a 4xx."""
    from scheduler_hints.extender import BadRequest, NotHeld
    from scheduler_hints.extender_wire import BadJSON

    try:
        body = decoder.decode(raw)
        if verb == "filter":
            return ext.filter(body)
        if verb == "prioritize":
            return ext.prioritize(body)
        return asyncio.run(ext.bind(body))
    except (BadJSON, BadRequest, NotHeld):
        return None


def _mutations(seed: bytes):
    return st.tuples(st.integers(0, len(seed)), st.integers(0, 40), st.binary(max_size=40)).map(
        lambda t: seed[:t[0]] + t[2] + seed[t[0] + t[1]:])


@given(verb=st.sampled_from(["filter", "prioritize", "bind"]), raw=st.one_of(
    st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()), _mutations(EXTENDER_ARGS),
    st.builds(lambda v: json.dumps({"Pod": v, "Nodes": {"items": [v]}, "NodeNames": v}).encode(), JSON),
    st.builds(lambda v: json.dumps({"PodName": v, "PodNamespace": v, "PodUID": v, "Node": v}).encode(), JSON)))
@example(verb="filter", raw=b'{"Pod": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
@example(verb="filter", raw=b'{"Pod": {}, "Nodes": {"items": [{"metadata": {"name": 1e999}}]}}')
@example(verb="prioritize", raw=b'{"Pod": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": '
                                 b'"99999999999999999999999"}}}]}}, "NodeNames": ["a"]}')
@example(verb="bind", raw=b'{"PodName": "p", "PodNamespace": "ml", "PodUID": "u", "Node": "a", "x": [1]}')
def test_extender_requests_are_answered_or_refused_with_a_4xx(verb, raw):
    ext, decoder = _extender()
    result = _answer(ext, decoder, verb, raw)
    if result is not None:
        from scheduler_hints.extender_wire import encode

        encode(result)  # whatever is answered can be written back


def test_a_50_mb_body_is_refused_before_it_is_read():
    from aiohttp.test_utils import TestClient, TestServer

    from scheduler_hints.extender import Extender
    from scheduler_hints.extender_http import make_app

    async def go():
        async with TestClient(TestServer(make_app(Extender()))) as client:
            r = await client.post("/filter", data=io.BytesIO(b"[" * 50_000_000))
            return r.status

    assert asyncio.run(go()) == 413


# -- S3 listing pages ----------------------------------------------------------------------------------------
LIST_PAGE = b"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix>ds/</Prefix>
<KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><EncodingType>url</EncodingType><IsTruncated>false</IsTruncated>
<Contents><Key>ds/a%2Fb.bin</Key><LastModified>2026-11-29T10:00:00.000Z</LastModified><ETag>"9e1"</ETag>
<Size>1024</Size><StorageClass>STANDARD</StorageClass></Contents>
<Contents><Key>ds/c.txt</Key><LastModified>2026-11-29T10:00:01.000Z</LastModified><ETag>"9e2"</ETag>
<Size>7</Size><StorageClass>STANDARD</StorageClass></Contents>
<CommonPrefixes><Prefix>ds/sub/</Prefix></CommonPrefixes></ListBucketResult>"""

_ENTITIES = "".join(f'<!ENTITY lol{i} "{f"&lol{i - 1};" * 10}">' for i in range(2, 10))
BILLION_LAUGHS = (f'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol1 "lol">{_ENTITIES}]>'
                  '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Contents><Key>&lol9;</Key>'
                  '<Size>1</Size><LastModified>2026-11-29T10:00:00.000Z</LastModified></Contents>'
                  '</ListBucketResult>').encode()


def _key_xml(key: str) -> bytes:
    from xml.sax.saxutils import escape

    return LIST_PAGE.replace(b"ds/c.txt", escape(key).encode("utf-8", "surrogatepass"))


@given(page=st.one_of(st.binary(max_size=300), _mutations(LIST_PAGE),
                      st.text(max_size=30).map(lambda k: _key_xml("ds/" + k)),
                      st.sampled_from(["..", "../x", "a/../../etc", "a//b", "./x", "x\x00y", "\x01", "a/\x7f"]).map(
                          lambda k: _key_xml("ds/" + k)),
                      st.text(max_size=8).map(lambda s: LIST_PAGE.replace(b"<Size>7</Size>",
                                                                           f"<Size>{s}</Size>".encode()))))
@example(page=BILLION_LAUGHS)
@example(page=LIST_PAGE.replace(b"ds/c.txt", b"ds/a%2Fb.bin"))  # a duplicate key
@example(page=LIST_PAGE[:len(LIST_PAGE) // 2])  # truncated
@example(page=LIST_PAGE.replace(b"<Prefix>ds/sub/</Prefix>", b""))  # a CommonPrefixes without its Prefix
@example(page=LIST_PAGE.replace(b"10:00:01.000Z", b"10:00:01.AZ"))  # a time zone dateutil warns about
@example(page=LIST_PAGE.replace(b'encoding="UTF-8"', b'encoding="TF-8"'))  # an encoding Python does not know
def test_listing_pages_never_yield_an_entry_outside_the_dataset(page):
    from cachefs.manifest import valid_relpath
    from cachefs.sources.s3 import parse_timestamp
    from cachefs.sources.s3_get import parse_list_page

    parsed = parse_list_page(page, parse_timestamp)  # None: botocore reads the answer instead
    if parsed is None:
        return
    for obj in parsed["Contents"]:
        assert isinstance(obj["Key"], str) and isinstance(obj["Size"], int)
        rel = obj["Key"][len("ds/"):] if obj["Key"].startswith("ds/") else None
        if rel is not None and valid_relpath(rel) is None:  # what the manifest keeps; other names are skipped
            parts = rel.split("/")
            assert ".." not in parts and "." not in parts and "" not in parts and "\x00" not in rel


def test_entity_expansion_is_refused():
    from cachefs.sources.s3 import parse_timestamp
    from cachefs.sources.s3_get import parse_list_page

    assert parse_list_page(BILLION_LAUGHS, parse_timestamp) is None


# -- our HTTP/1.1 response reader ----------------------------------------------------------------------------
GOOD_HEAD = (b"HTTP/1.1 206 Partial Content\r\nx-amz-request-id: 7C1\r\nETag: \"9e1\"\r\n"
             b"Content-Range: bytes 0-9/1024\r\nContent-Length: 10\r\n\r\n0123456789")


class _Transport:
    def write(self, data): pass
    def close(self): pass
    def abort(self): pass


def _read_response(chunks: list[bytes], max_body: int = 1 << 20):
    """Feed ``chunks`` to a connection as the event loop would, then the server's EOF; the response or the error."""
    from cachefs.sources.http1 import _Connection

    async def go():
        conn = _Connection()
        conn.connection_made(_Transport())
        task = asyncio.ensure_future(conn.request(b"GET / HTTP/1.1\r\n\r\n", max_body))
        await asyncio.sleep(0)
        for chunk in chunks:
            while chunk:
                buf = conn.get_buffer(-1)
                n = min(len(buf), len(chunk))
                if n == 0:
                    break
                buf[:n] = chunk[:n]
                del buf  # as the event loop does: the view is gone before the protocol hears of the bytes
                conn.buffer_updated(n)
                chunk = chunk[n:]
        conn.eof_received()
        try:
            return await asyncio.wait_for(task, 5)
        except ConnectionError as exc:  # UnsupportedResponse is one: botocore takes the request over
            return exc

    return asyncio.run(go())


def _split(data: bytes):
    return st.lists(st.integers(0, len(data)), max_size=6).map(
        lambda cuts: [data[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(data)], strict=True)])


@given(chunks=st.one_of(_split(GOOD_HEAD), _mutations(GOOD_HEAD).flatmap(_split), st.lists(st.binary(max_size=80),
                                                                                          max_size=4)))
@example(chunks=[b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde"])
@example(chunks=[b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n0\r\n\r\n"])
@example(chunks=[b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 9_000 + b"Content-Length: 1\r\n\r\nx"])
@example(chunks=[b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n0123456789"])
@example(chunks=[b"HTTP/1.1 200 OK\r\nContent-Length: +4\r\n\r\nabcd"])
@example(chunks=[b"garbage\r\n\r\n"])
def test_http_responses_are_read_exactly_or_refused(chunks):
    from cachefs.sources.http1 import Response

    got = _read_response(chunks)
    if isinstance(got, Response):
        raw = b"".join(chunks)
        head, _, rest = raw.partition(b"\r\n\r\n")
        lengths = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")[1:]
                   if line.split(b":", 1)[0].strip().lower() == b"content-length"]
        assert len(set(lengths)) == 1 and lengths[0].isdigit(), lengths  # one plain length, or refused
        # exactly the announced bytes (any that follow them end the connection, not the response)
        assert bytes(got.body) == rest[:int(lengths[0])] and len(rest) >= int(lengths[0])
    else:
        assert isinstance(got, ConnectionError), got


# -- what users type -----------------------------------------------------------------------------------------
@given(url=st.one_of(st.text(max_size=40), st.text(max_size=20).map(lambda s: f"s3://{s}"),
                     st.sampled_from(["s3:/data", "s3://", "s3://Bad_Bucket!!", "file://", "://x", "s3://b/../x",
                                      "s3://b/\x00", "htp:/bad", "A://[", "0://0://\x00"])))
def test_dataset_urls_are_accepted_or_refused_clearly(url):
    from cachefs.base.errors import InvalidURLError
    from cachefs.base.types import DatasetRef

    try:
        ref = DatasetRef.from_url(url)
    except InvalidURLError:  # one line, exit code 2 at the CLI
        return
    assert ref.url and "\x00" not in ref.url


@given(include=st.lists(st.text(max_size=12), max_size=3), exclude=st.lists(st.text(max_size=12), max_size=3))
@example(include=["[", "**/[!a-", "\\"], exclude=["*]"])
def test_include_exclude_globs_select_or_refuse_clearly(include, exclude):
    from cachefs.base.types import Entry
    from cachefs.jobs.warm import select_files

    files = [Entry("a/b/c.txt", 1, "e", 0.0), Entry("[x].bin", 2, "e", 0.0)]
    chosen = list(select_files(files, include or None, exclude or None))
    assert all(e in files for e in chosen)


@given(doc=st.one_of(st.text(max_size=200), JSON.map(json.dumps),
                     st.dictionaries(st.sampled_from(["cache", "engine", "origin", "cluster", "metrics", "x"]),
                                     JSON, max_size=3).map(json.dumps)))
def test_yaml_config_is_loaded_or_refused_clearly(doc, tmp_path_factory):
    from cachefs.base.config import load_config
    from cachefs.base.errors import ConfigError

    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(doc)
    try:
        load_config(str(path), env={})
    except ConfigError:
        pass


@given(attrs=st.dictionaries(st.sampled_from(["url", "dataset", "endpointUrl", "region", "other",
                                             "csi.storage.k8s.io/pod.name"]),
                             st.text(max_size=30), max_size=4),
       volume_id=st.text(max_size=60), secrets=st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=4))
@example(attrs={"url": "s3:/x"}, volume_id="cachefs:!!!", secrets={"": ""})
@example(attrs={"url": "s3://b/p", "region": "\x00"}, volume_id="cachefs-", secrets={"awsAccessKeyID": "\n"})
def test_csi_volume_attributes_ids_and_secrets_are_accepted_or_refused_clearly(attrs, volume_id, secrets):
    from csi.volume import DatasetVolume, VolumeError, credentials_env

    try:
        vol = DatasetVolume.from_attributes(attrs)
        assert DatasetVolume.from_volume_id(vol.volume_id) == vol
    except VolumeError:
        pass
    try:
        DatasetVolume.from_volume_id(volume_id)
    except VolumeError:
        pass
    env = credentials_env(secrets)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


# -- files read back from disk or the origin -----------------------------------------------------------------
def _flipped(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for i, x in flips:
        out[i] ^= x
    return bytes(out)


def _flips(data: bytes):
    """``data`` with a few bytes changed, or cut short."""
    return st.one_of(
        st.lists(st.tuples(st.integers(0, max(0, len(data) - 1)), st.integers(1, 255)), min_size=1, max_size=4).map(
            lambda flips: _flipped(data, flips)),
        st.integers(0, max(0, len(data) - 1)).map(lambda n: data[:n]))


def _mirror_files():
    """A real mirror's mirror.json and index.arrow, as `cachefs pack` writes them (for dataset s3://b/ds)."""
    import pyarrow as pa

    rows = {"path": ["a/0.jpg", "a/1.jpg", "b/2.jpg"], "version": ["e0", "e1", "e2"], "pack": [0, 0, 1],
            "offset": [0, 100, 0], "length": [100, 50, 70], "checksum": [1, 2, 3]}
    sink = pa.BufferOutputStream()
    table = pa.table(rows)
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    index = sink.getvalue().to_pybytes()
    from cachefs.formats.mirror_index import FORMAT

    meta = json.dumps({"format": FORMAT, "source": "s3://b/ds", "index": {"name": "index.arrow", "version": "v",
                                                                          "size": len(index)},
                       "packs": [{"name": "p0", "size": 150}, {"name": "p1", "size": 70}]}).encode()
    return meta, index


MIRROR_META, MIRROR_INDEX = _mirror_files()


@given(meta=st.one_of(st.just(MIRROR_META), _flips(MIRROR_META)), index=st.one_of(st.just(MIRROR_INDEX),
                                                                                    _flips(MIRROR_INDEX)))
def test_a_damaged_mirror_is_refused_never_misread(meta, index):
    from cachefs.base.errors import CacheFSError
    from cachefs.base.types import DatasetRef
    from cachefs.formats.mirror_index import parse_index, parse_meta

    ref = DatasetRef.from_url("s3://b/ds")
    try:
        parsed = parse_meta(ref, "s3://b/ds.cachefs", meta)
        if parsed is None:
            return
        mirror = parse_index(ref, "s3://b/ds.cachefs", parsed, index)
    except CacheFSError:
        return
    for pack, offset, length, _checksum in mirror.entries.values():  # every member inside its pack
        assert 0 <= offset and offset + length <= mirror.pack_sizes[pack]


@given(raw=st.one_of(st.binary(max_size=100), st.builds(lambda: None).flatmap(
    lambda _: _flips(__import__("msgspec").msgpack.encode([1, "s3://b/ds", [["a.txt", 5, "e", 1.0]]])))))
def test_a_damaged_shipped_manifest_is_refused(raw):
    from cachefs.base.errors import CacheFSError
    from cachefs.manifest.shipping import unpack_manifest

    try:
        entries = unpack_manifest(raw, "s3://b/ds")
    except CacheFSError:
        return
    assert all(e.size >= 0 and isinstance(e.path, str) for e in entries)

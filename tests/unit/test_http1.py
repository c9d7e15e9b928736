"""The origin's HTTP/1.1 GET client against scripted servers on loopback (plain and TLS): bodies in any
segmentation, keep-alive reuse, a server closing idle connections, responses it refuses, drops mid-body,
cancellation, and error translation."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl

import pytest

from cachefs.base.errors import OriginUnavailableError, TruncatedBodyError, translate_origin_error
from cachefs.sources.http1 import Http1Pool, UnsupportedResponse

CLOSE = object()  # at the end of a response's parts: close the connection after sending them


class Scripted:
    """A loopback server: ``respond(request_head, nth)`` gives the byte strings to send for the ``nth`` request
    on a connection (``CLOSE`` last: then close; None: close without answering); pauses between them let the
    client see them as separate reads. ``count`` is the number of requests seen on all connections."""

    def __init__(self, respond, tls: ssl.SSLContext | None = None) -> None:
        self.respond, self.tls = respond, tls
        self.connections = 0
        self.heads: list[bytes] = []

    @property
    def count(self) -> int:
        return len(self.heads)

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for nth in range(1000):
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                parts = self.respond(head, nth)
                if parts is None:
                    break
                for part in parts:
                    if part is CLOSE:
                        return
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.005)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes, status: str = "206 Partial Content", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nETag: \"x\"\r\n{extra}\r\n".encode() + body


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


BODY = os.urandom(3 * 1024 * 1024 + 17)
LIMIT = 8 << 20


@pytest.mark.parametrize("split", ["whole", "head-and-body-apart", "body-in-the-head-packet", "one-byte-head"])
def test_bodies_arrive_whole_in_any_segmentation(split):
    response = ok(BODY)
    cut = response.index(b"\r\n\r\n") + 4
    parts = {"whole": [response],
             "head-and-body-apart": [response[:cut], response[cut:]],
             "body-in-the-head-packet": [response[:cut + 1000], response[cut + 1000:cut + 5000], response[cut + 5000:]],
             "one-byte-head": [response[i:i + 1] for i in range(cut)] + [response[cut:]]}[split]

    async def go():
        async with Scripted(lambda head, nth: parts) as srv:
            pool = Http1Pool(4, 5.0)
            r = await pool.get(f"http://127.0.0.1:{srv.port}/bucket/k%20ey?x-id=GetObject", {"Range": "bytes=0-9"},
                               len(BODY))
            await pool.close()
            return r, srv.heads[0]

    r, head = run(go())
    assert r.status == 206 and r.headers["etag"] == '"x"'
    assert bytes(r.body) == BODY and isinstance(r.body, bytearray)
    assert head.startswith(b"GET /bucket/k%20ey?x-id=GetObject HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in head and b"\r\nRange: bytes=0-9\r\n" in head


def test_keep_alive_reuses_one_connection_and_a_given_host_header_is_not_doubled():
    async def go():
        async with Scripted(lambda head, nth: [ok(b"%d" % nth)]) as srv:
            pool = Http1Pool(4, 5.0)
            got = [bytes((await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {"host": "example:1"}, LIMIT)).body)
                   for _ in range(5)]
            await pool.close()
            return got, srv

    got, srv = run(go())
    assert got == [b"0", b"1", b"2", b"3", b"4"]
    assert srv.connections == 1
    assert all(h.lower().count(b"\r\nhost:") == 1 for h in srv.heads)
    assert all(b"\r\nhost: example:1\r\n" in h for h in srv.heads)


def test_a_server_closing_idle_connections_is_met_with_a_new_one():
    # Each connection answers one request, then closes without saying so (no "Connection: close").
    async def go():
        async with Scripted(lambda head, nth: [ok(b"body")] if nth == 0 else None) as srv:
            pool = Http1Pool(4, 5.0)
            out = []
            for _ in range(3):
                out.append(bytes((await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, LIMIT)).body))
                await asyncio.sleep(0.05)  # let the close arrive (or not) before the next request
            await pool.close()
            return out, srv.connections

    out, conns = run(go())
    assert out == [b"body"] * 3
    assert conns == 3


def test_connection_close_is_honoured():
    async def go():
        async with Scripted(lambda head, nth: [ok(b"a", extra="Connection: close\r\n")]) as srv:
            pool = Http1Pool(4, 5.0)
            for _ in range(2):
                assert bytes((await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, LIMIT)).body) == b"a"
            await pool.close()
            return srv.connections

    assert run(go()) == 2


@pytest.mark.parametrize("response", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nno length",
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * (70 * 1024) + b"\r\nContent-Length: 1\r\n\r\nz",
    b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nbroken header line\r\nContent-Length: 1\r\n\r\nz",
])
def test_responses_it_does_not_read_are_refused_and_the_connection_dropped(response):
    async def go():
        srv = Scripted(lambda head, nth: [response, ok(b"next")] if srv.count == 1 else [ok(b"next")])
        async with srv:
            pool = Http1Pool(4, 5.0)
            with pytest.raises(UnsupportedResponse):
                await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, LIMIT)
            # the refused connection is not reused: the next request opens a new one and gets its own answer
            r = await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, LIMIT)
            await pool.close()
            return r, srv.connections

    r, conns = run(go())
    assert conns == 2
    assert bytes(r.body) == b"next"


def test_a_body_over_the_limit_is_refused_before_it_is_allocated():
    async def go():
        srv = Scripted(lambda head, nth: [b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\nxx"]
                       if srv.count == 1 else [ok(b"small")])
        async with srv:
            pool = Http1Pool(4, 5.0)
            with pytest.raises(UnsupportedResponse, match="over the 1024"):
                await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, 1024)
            r = await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, 1024)
            await pool.close()
            return bytes(r.body), srv.connections

    assert run(go()) == (b"small", 2)


def test_error_statuses_come_back_with_their_body():
    async def go():
        async with Scripted(lambda head, nth: [ok(b"<Error><Code>PreconditionFailed</Code></Error>",
                                                  status="412 Precondition Failed")]) as srv:
            pool = Http1Pool(4, 5.0)
            r = await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {"If-Match": '"v1"'}, LIMIT)
            await pool.close()
            return r

    r = run(go())
    assert r.status == 412 and b"PreconditionFailed" in r.body


def test_a_drop_mid_body_is_a_truncated_body_error_not_a_short_answer():
    response = ok(BODY)

    async def go():
        async with Scripted(lambda head, nth: [response[:len(response) // 2], CLOSE]) as srv:
            pool = Http1Pool(4, 5.0)
            try:
                await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, LIMIT)
            finally:
                await pool.close()

    with pytest.raises(ConnectionResetError) as info:
        run(go())
    assert isinstance(translate_origin_error(info.value, "s3://b/k"), TruncatedBodyError)


def test_a_cancelled_request_leaves_no_connection_behind_to_be_reused():
    async def go():
        # the first request overall gets 100 bytes and never the rest
        srv = Scripted(lambda head, nth: [ok(BODY)[:100]] if srv.count == 1 else [ok(b"fresh")])
        async with srv:
            pool = Http1Pool(4, 5.0)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, LIMIT), 0.3)
            r = await pool.get(f"http://127.0.0.1:{srv.port}/b/k", {}, LIMIT)
            await pool.close()
            return bytes(r.body), srv.connections

    body, conns = run(go())
    assert body == b"fresh" and conns == 2


def test_refused_connection_is_an_unreachable_origin():
    async def go():
        pool = Http1Pool(4, 5.0)
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        await pool.get(f"http://127.0.0.1:{port}/b/k", {}, LIMIT)

    with pytest.raises(ConnectionRefusedError) as info:
        run(go())
    assert isinstance(translate_origin_error(info.value, "s3://b/k"), OriginUnavailableError)


def test_not_an_http_url_is_a_clear_error():
    with pytest.raises(ValueError, match="not an http"):
        run(Http1Pool(1, 1.0).get("ftp://127.0.0.1/x", {}, LIMIT))


@pytest.mark.parametrize("url, headers", [
    ("http://127.0.0.1:9/b/k", {"If-Match": '"v1"\r\nX-Injected: 1'}),
    ("http://127.0.0.1:9/b/k", {"Range\n": "bytes=0-1"}),
    ("http://127.0.0.1:9/b/a key", {}),
])
def test_no_line_break_or_space_reaches_the_wire(url, headers):
    with pytest.raises(ValueError, match="line break or space"):
        run(Http1Pool(1, 1.0).get(url, headers, LIMIT))


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_bodies_are_received_straight_and_certificates_are_checked(tmp_path):
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    async def go():
        async with Scripted(lambda head, nth: [ok(BODY)], tls=server_tls) as srv:
            pool = Http1Pool(4, 5.0, trusting)
            r1 = await pool.get(f"https://127.0.0.1:{srv.port}/b/k", {}, LIMIT)
            r2 = await pool.get(f"https://127.0.0.1:{srv.port}/b/k", {}, LIMIT)
            await pool.close()
            strict = Http1Pool(4, 5.0)  # the system's trust store does not know this certificate
            with pytest.raises(ssl.SSLCertVerificationError):
                await strict.get(f"https://127.0.0.1:{srv.port}/b/k", {}, LIMIT)
            await strict.close()
            return r1, r2, srv.connections

    r1, r2, conns = run(go())
    assert bytes(r1.body) == BODY and bytes(r2.body) == BODY
    assert conns == 1  # one connection kept alive for both (the strict client never got past the handshake)

"""A small HTTP/1.1 client for the origin's GETs, whose bodies are received straight into one buffer.

Why: aiohttp's request machinery (request and response objects, header multidicts, the streaming body, one
chunk object per socket read and a join at the end) was the largest item in a small-file prefetch's client
CPU (py-spy: ~30 % of the event loop). Through this client a 20,000-file prefetch on the 10 ms / 1 Gbit/s test
link used 15.6–15.7 s of client CPU against 19.9–20.8 s, and took 19.5–20.3 s against 23.1–24.4 s (two
interleaved rounds each). The connection is an :class:`asyncio.BufferedProtocol`: once the header is read,
the kernel (or the TLS layer) copies the body directly into a ``bytearray`` of the response's
``Content-Length``. (For 4 MiB blocks that measured no different: with the engine's pinned mmap threshold the
block's buffer is a fresh mapping either way, and faulting it in costs more than the copies saved.)

It does what an S3 GET needs and nothing else: ``GET`` on keep-alive connections (a pool per host), a
``Content-Length`` body, plain or TLS. A response it does not take (chunked, no length, a header over 64 KiB,
a body longer than the caller allows, so that a server's word alone never sizes an allocation) raises
:class:`UnsupportedResponse`; the caller sends the request another way.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Http1Pool", "Response", "UnsupportedResponse"]

_MAX_HEAD = 64 * 1024


class UnsupportedResponse(ConnectionError):
    """A response this client does not read (chunked, no Content-Length, an oversized header or body)."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytearray


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._head = bytearray(8192)
        self._head_len = 0
        self._body: memoryview | None = None
        self._buffer: bytearray | None = None
        self._got = 0
        self._response: Response | None = None
        self._waiter: asyncio.Future | None = None
        self._max_body = 0
        self.reusable = True

    # -- protocol -----------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body[self._got:]
        if self._head_len == len(self._head):
            # A long header: grow (bounded in buffer_updated) into a new buffer, as a view of the old one may
            # still be held by whoever filled it (extending it in place would raise BufferError).
            self._head = self._head + bytes(len(self._head))
        return memoryview(self._head)[self._head_len:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._got += nbytes
        else:
            self._head_len += nbytes
            if self._waiter is None:  # bytes nobody asked for: the connection is out of step
                self.reusable = False
                self._abort(ConnectionError("unexpected bytes from the server"))
                return
            end = self._head.find(b"\r\n\r\n", 0, self._head_len)
            if end > _MAX_HEAD or (end < 0 and self._head_len > _MAX_HEAD):
                self._fail(UnsupportedResponse("response header over 64 KiB"))
                return
            if end < 0:
                return
            try:
                self._start_body(end)
            except (UnsupportedResponse, ValueError) as exc:
                self._fail(exc if isinstance(exc, UnsupportedResponse) else UnsupportedResponse(str(exc)))
                return
        if self._body is not None and self._got == len(self._body):
            self._finish()

    def eof_received(self) -> bool:
        self.reusable = False
        self._fail(ConnectionResetError("the server closed the connection mid-response"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(exc or ConnectionResetError("connection closed"))

    # -- requests -----------------------------------------------------------------------------------------
    async def request(self, head: bytes, max_body: int) -> Response:
        assert self._waiter is None and self.transport is not None
        self._head_len, self._body, self._buffer, self._got, self._response = 0, None, None, 0, None
        self._max_body = max_body
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head)
        return await self._waiter

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def _start_body(self, end: int) -> None:
        lines = bytes(self._head[:end]).decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise UnsupportedResponse(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        status = int(rest[:3])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise UnsupportedResponse(f"malformed header line {line[:80]!r}")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length" and headers.get(name, value) != value:
                raise UnsupportedResponse("conflicting Content-Length headers")
            headers[name] = value
        if "transfer-encoding" in headers or "content-length" not in headers:
            raise UnsupportedResponse("a response without Content-Length")
        raw_length = headers["content-length"]
        if not (raw_length.isascii() and raw_length.isdigit()):  # int() would take "+4", " 4", "1_0"
            raise UnsupportedResponse(f"Content-Length {raw_length[:40]!r} is not a number of bytes")
        length = int(raw_length)
        if length > self._max_body:  # never allocated: the buffer is sized by what the server says
            raise UnsupportedResponse(f"a body of {length} bytes, over the {self._max_body} this request allows")
        if headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
            self.reusable = False
        extra = self._head_len - end - 4
        if extra > length:  # more than the body: a pipelining server, or garbage
            self.reusable = False
            raise UnsupportedResponse("bytes after the response body")
        self._buffer = bytearray(length)
        self._buffer[:extra] = self._head[end + 4 : self._head_len]
        self._body, self._got = memoryview(self._buffer), extra
        self._response = Response(status, headers, self._buffer)

    def _finish(self) -> None:
        waiter, self._waiter = self._waiter, None
        response, self._response, self._body, self._buffer = self._response, None, None, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _fail(self, exc: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        self._body = None
        if waiter is not None and not waiter.done():
            self.reusable = False
            waiter.set_exception(exc)

    def _abort(self, exc: BaseException) -> None:
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()


class Http1Pool:
    """Keep-alive connections per (scheme, host, port), at most ``limit`` open at once in all."""

    def __init__(self, limit: int, connect_timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self._slots = asyncio.Semaphore(max(1, limit))
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._closed = False

    async def get(self, url: str, headers: dict[str, str], max_body: int) -> Response:
        """``GET url`` (already percent-encoded) with ``headers`` (``Host`` from the URL unless given). A response
        whose ``Content-Length`` exceeds ``max_body`` is refused (:class:`UnsupportedResponse`) before its buffer
        is allocated."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        where = (parts.scheme, parts.hostname, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"GET {target} HTTP/1.1"]
        if not any(k.lower() == "host" for k in headers):
            lines.append(f"Host: {parts.netloc}")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if any(c in line for line in lines for c in "\r\n") or " " in target:
            raise ValueError(f"a line break or space inside the request line or a header: {lines[0][:80]!r}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        async with self._slots:
            conn = self._idle_connection(where)
            if conn is not None:
                try:
                    return await self._exchange(conn, where, head, max_body)
                except (ConnectionResetError, BrokenPipeError):
                    pass  # the server closed it while it was idle: once more on a new connection
            loop = asyncio.get_running_loop()
            tls = None
            if where[0] == "https":
                if self._ssl is None:  # once: it loads the system's trust store
                    self._ssl = ssl.create_default_context()
                tls = self._ssl
            _, new = await asyncio.wait_for(loop.create_connection(_Connection, where[1], where[2], ssl=tls),
                                            self._connect_timeout)
            return await self._exchange(new, where, head, max_body)

    def _idle_connection(self, where: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(where)
        while idle:
            conn = idle.pop()
            if conn.reusable and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _exchange(self, conn: _Connection, where: tuple[str, str, int], head: bytes, max_body: int
                        ) -> Response:
        """One request on ``conn``; the connection goes back to the idle list if it can carry another."""
        try:
            response = await conn.request(head, max_body)
        except BaseException:
            conn.close()  # failed or cancelled mid-response: its state is unknown
            raise
        if conn.reusable and not self._closed:
            self._idle.setdefault(where, []).append(conn)
        else:
            conn.close()
        return response

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

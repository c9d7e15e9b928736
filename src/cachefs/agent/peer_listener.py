"""Where the peer server listens, and what one client may hold there.

aiohttp closes a connection that has not sent a whole request head within its keep-alive timeout, and an idle
one after it; we set that timeout to ``cluster.idle_timeout`` (30 s; aiohttp's own default is an hour). What aiohttp does
not bound is how many connections one client holds: a single host opening sockets could use up the agent's
file descriptors and starve the members that need it. :class:`PerClientLimit` wraps the server's protocol factory
and refuses (closes at once) a client's connections past ``max_per_client``; members themselves hold a pool of
at most a few dozen (:mod:`cachefs.cluster.peer_client`). The agent also raises its descriptor limit to the hard
limit at start (:func:`raise_fd_limit`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import ssl
from collections import Counter

from aiohttp import web

from cachefs.base.metrics import PEER_REFUSED_CONNECTIONS, safely

__all__ = ["PeerListener", "PerClientLimit", "raise_fd_limit"]

log = logging.getLogger("cachefs.agent.peer_server")


class PerClientLimit:
    """A protocol factory that admits at most ``max_per_client`` open connections per client address."""

    def __init__(self, factory, max_per_client: int) -> None:
        self.factory, self.max_per_client = factory, max_per_client
        self.open: Counter[str] = Counter()
        self.refused = 0

    def __call__(self) -> asyncio.Protocol:
        return _Admitted(self, self.factory())


class _Admitted(asyncio.Protocol):
    """Passes a connection to the server's protocol if its client is under the limit, else closes it."""

    def __init__(self, limit: PerClientLimit, inner: asyncio.Protocol) -> None:
        self.limit, self.inner = limit, inner
        self.client: str | None = None

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self.limit.open[client] >= self.limit.max_per_client:
            self.limit.refused += 1
            safely(PEER_REFUSED_CONNECTIONS.inc)
            log.warning("refused a connection from %s: it holds %d already (the most one client may)", client,
                        self.limit.max_per_client)
            transport.abort()
            return
        self.client = client
        self.limit.open[client] += 1
        self.inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        if self.client is None:
            return
        self.limit.open[self.client] -= 1
        if self.limit.open[self.client] <= 0:
            del self.limit.open[self.client]
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.client is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.client is not None else None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class PeerListener:
    """The peer server's socket: ``app`` served on ``host:port`` (TLS with ``ssl_context``), each client held to
    ``max_per_client`` connections, idle connections and half-sent request heads closed after ``idle_timeout``."""

    def __init__(self, app: web.Application, host: str, port: int, *, max_per_client: int, idle_timeout: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.app, self.host, self.port, self.ssl_context = app, host, port, ssl_context
        self.max_per_client = max_per_client
        self.runner = web.AppRunner(app, access_log=None, keepalive_timeout=idle_timeout)
        self.limit: PerClientLimit | None = None
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; OSError (the address in use, say) after cleaning up."""
        await self.runner.setup()
        assert self.runner.server is not None
        self.limit = PerClientLimit(self.runner.server, self.max_per_client)
        try:
            self._server = await asyncio.get_running_loop().create_server(
                self.limit, self.host, self.port, ssl=self.ssl_context, reuse_address=True, backlog=1024)
        except OSError:
            await self.runner.cleanup()
            raise

    @property
    def bound_port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.runner.cleanup()


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (containers often start at 1024); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft

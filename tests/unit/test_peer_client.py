"""The peer client reads whole answers however the network splits them, and refuses wrong ones."""

from __future__ import annotations

import asyncio
import os

import pytest
from aiohttp import web

from cachefs.base.checksum import block_checksum
from cachefs.cluster.peer_client import CHECKSUM_HEADER, PeerClient, PeerError

DATA = os.urandom(1 << 20)


async def serve(handler):
    app = web.Application()
    app.router.add_get("/v1/block/{ds}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def trickle(body: bytes, checksum: int):
    async def handler(request):
        resp = web.StreamResponse(headers={CHECKSUM_HEADER: f"{checksum:016x}", "Content-Length": str(len(body))})
        await resp.prepare(request)
        for i in range(0, len(body), 100_000):  # pieces with pauses, as a slow link delivers them
            await resp.write(body[i:i + 100_000])
            await asyncio.sleep(0.01)
        return resp
    return handler


@pytest.mark.parametrize(("body", "checksum", "ok"), [
    (DATA, block_checksum(DATA), True),
    (DATA[:-1] + bytes([DATA[-1] ^ 0xFF]), block_checksum(DATA), False),  # damaged on the way (a byte flipped:
    # setting it to 0 left the block whole whenever the random block ended in 0, one run in 256)
    (DATA[:-5], block_checksum(DATA[:-5]), False),  # short
], ids=["whole", "damaged", "short"])
def test_a_block_that_arrives_in_pieces_is_read_whole_and_checked(body, checksum, ok):
    async def go():
        runner, address = await serve(trickle(body, checksum))
        client = PeerClient("n1", None)
        try:
            return await client.block(address, "d" * 16, "s3://b/p", "x.bin", "etag", 0, len(DATA))
        finally:
            await client.close()
            await runner.cleanup()

    if ok:
        assert asyncio.run(go()) == (DATA, 0)
    else:
        with pytest.raises(PeerError):
            asyncio.run(go())

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


def test_a_manifest_is_waited_for_while_the_peer_lists_but_a_slow_block_is_given_up():
    """The member that lists a dataset for the group answers when its listing is done (minutes, for millions of
    objects): asking for the manifest waits past the client's timeout, or every member would list for itself."""
    manifest = b"a packed manifest"

    async def slow(request):
        await asyncio.sleep(1.0)  # the listing, or a hung owner of a block
        return web.Response(body=manifest, headers={CHECKSUM_HEADER: f"{block_checksum(manifest):016x}"})

    async def go():
        app = web.Application()
        app.router.add_get("/v1/manifest/{ds}", slow)
        app.router.add_get("/v1/block/{ds}", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        address = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        client = PeerClient("n1", None, timeout=0.2)
        try:
            got = await client.manifest(address, "d" * 16, url="s3://b/p")
            with pytest.raises(PeerError, match="Timeout"):
                await client.block(address, "d" * 16, "s3://b/p", "x.bin", "etag", 0, len(manifest))
            return got
        finally:
            await client.close()
            await runner.cleanup()

    assert asyncio.run(go()) == manifest

"""The conformance suite of :class:`~cachefs.sources.writes.ObjectWrites` (whole-object writes at the origin:
single and multipart uploads, conditional writes, copies, deletes): a test class subclasses
:class:`ObjectWritesConformance` and provides a ``writes_origin`` fixture (a :class:`WritesOrigin`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["ObjectWritesConformance", "WritesOrigin", "s3_object_getter"]


@dataclass
class WritesOrigin:
    """What a ``writes_origin`` fixture of :class:`ObjectWritesConformance` returns."""

    writes: Any
    root: str
    get: Callable[[str], bytes | None]


def s3_object_getter(client, bucket: str, prefix: str) -> Callable[[str], bytes | None]:
    """``get(key)``: the bytes of ``bucket/prefix/key`` through a boto3 client, or None when there is none."""
    def get(key: str) -> bytes | None:
        try:
            return client.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    return get


class ObjectWritesConformance:
    """Subclasses provide a ``writes_origin`` fixture: an object with ``.writes`` (an
    :class:`~cachefs.sources.writes.ObjectWrites`), ``.root`` (a URL prefix to write under) and ``.get(key)`` (the
    object's bytes, or None when there is none)."""

    PART = 5 * 1024 * 1024

    def _run(self, origin, scenario):
        async def main():
            try:
                return await scenario(origin.writes)
            finally:
                await origin.writes.close()

        return asyncio.run(main())

    def test_put_replaces_and_a_conditional_put_never_replaces(self, writes_origin):
        from cachefs.base.errors import CommitConflictError

        root = writes_origin.root

        async def scenario(w):
            assert await w.put(f"{root}/a", b"one")
            await w.put(f"{root}/a", b"two")
            await w.put(f"{root}/new", b"first", if_none_match=True)
            with pytest.raises(CommitConflictError):
                await w.put(f"{root}/new", b"second", if_none_match=True)

        self._run(writes_origin, scenario)
        assert writes_origin.get("a") == b"two" and writes_origin.get("new") == b"first"

    def test_racing_conditional_puts_one_wins(self, writes_origin):
        """What a commit race relies on: of writers racing to create one name, exactly one succeeds."""
        from cachefs.base.errors import CommitConflictError

        root = writes_origin.root

        async def scenario(w):
            async def attempt(i):
                try:
                    await w.put(f"{root}/claim", f"writer {i}".encode(), if_none_match=True)
                    return i
                except CommitConflictError:
                    return None

            return [i for i in await asyncio.gather(*(attempt(i) for i in range(16))) if i is not None]

        winners = self._run(writes_origin, scenario)
        assert len(winners) == 1 and writes_origin.get("claim") == f"writer {winners[0]}".encode()

    def test_a_multipart_upload_appears_whole_only_when_completed(self, writes_origin):
        root, part = writes_origin.root, self.PART
        data = os.urandom(part) + os.urandom(12345)

        async def scenario(w):
            upload = await w.start_multipart(f"{root}/big")
            second = await w.put_part(f"{root}/big", upload, 2, data[part:])  # parts may go up in any order
            first = await w.put_part(f"{root}/big", upload, 1, data[:part])
            assert writes_origin.get("big") is None
            await w.complete_multipart(f"{root}/big", upload, [first, second])
            aborted = await w.start_multipart(f"{root}/gone")
            await w.put_part(f"{root}/gone", aborted, 1, b"x" * 10)
            await w.abort_multipart(f"{root}/gone", aborted)
            await w.abort_multipart(f"{root}/gone", aborted)  # (twice: fine)

        self._run(writes_origin, scenario)
        assert writes_origin.get("big") == data and writes_origin.get("gone") is None

    def test_unfinished_uploads_of_one_object_are_listed_until_aborted(self, writes_origin):
        """What a restart relies on to find the uploads a killed process began: those of exactly that key."""
        root = writes_origin.root

        async def scenario(w):
            mine = {await w.start_multipart(f"{root}/ck.pt") for _ in range(2)}
            other = await w.start_multipart(f"{root}/ck.pt.other")  # (same prefix, another object)
            done = await w.start_multipart(f"{root}/ck.pt")
            await w.complete_multipart(f"{root}/ck.pt", done, [await w.put_part(f"{root}/ck.pt", done, 1, b"x")])
            assert set(await w.unfinished_multipart(f"{root}/ck.pt")) == mine
            for upload in mine:
                await w.abort_multipart(f"{root}/ck.pt", upload)
            assert await w.unfinished_multipart(f"{root}/ck.pt") == []
            assert await w.unfinished_multipart(f"{root}/ck.pt.other") == [other]
            await w.abort_multipart(f"{root}/ck.pt.other", other)

        self._run(writes_origin, scenario)
        assert writes_origin.get("ck.pt") == b"x"

    def test_a_conditional_copy_copies_only_the_object_it_names(self, writes_origin):
        """What a rename after the upload relies on: a copy pinned to the ETag this writer uploaded fails once
        another writer replaced the source, and when the source is gone."""
        from cachefs.base.errors import ObjectNotFoundError, StaleObjectError

        root = writes_origin.root

        async def scenario(w):
            mine = await w.put(f"{root}/shared.tmp", b"mine")
            assert await w.copy(f"{root}/shared.tmp", f"{root}/kept", 4, if_match=mine)
            await w.put(f"{root}/shared.tmp", b"theirs")
            with pytest.raises(StaleObjectError):
                await w.copy(f"{root}/shared.tmp", f"{root}/shared", 6, if_match=mine)
            await w.delete(f"{root}/shared.tmp")
            with pytest.raises(ObjectNotFoundError):
                await w.copy(f"{root}/shared.tmp", f"{root}/shared", 6, if_match=mine)

        self._run(writes_origin, scenario)
        assert writes_origin.get("kept") == b"mine" and writes_origin.get("shared") is None

    def test_copy_and_delete(self, writes_origin):
        root = writes_origin.root

        async def scenario(w):
            await w.put(f"{root}/src", b"bytes to copy")
            await w.copy(f"{root}/src", f"{root}/dst", 13)
            await w.delete(f"{root}/src")
            await w.delete(f"{root}/never-was")  # (missing: fine)

        self._run(writes_origin, scenario)
        assert writes_origin.get("dst") == b"bytes to copy" and writes_origin.get("src") is None

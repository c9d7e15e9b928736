"""The uploader on its own: a queue, a snapshot directory and a test S3 server, no volume. Entries finish in queue
order; its owner hears of each; a copy whose source another writer replaced asks the owner to upload its own bytes
instead, and fails for good when it has none."""

from __future__ import annotations

import asyncio
import os

from cachefs.node.budget import MemoryBudget
from cachefs.sources import open_object_writes, open_origin
from cachefs.write.queue import EntryKind, QueueEntry, UploadQueue
from cachefs.write.uploader import Uploader

MiB = 1 << 20


class Owner:
    """An UploadOwner that records what it is told; ``reupload_answer`` is what it says to a replaced source."""

    def __init__(self, snapdir: str, *, reupload_answer: bool = False) -> None:
        self.snapdir, self.reupload_answer = snapdir, reupload_answer
        self.finished: list[tuple[str, str, str]] = []  # (kind, key, failure)
        self.reuploads: list[tuple[str, str]] = []
        self.etags: dict[str, str] = {}
        self.done: asyncio.Event | None = None  # (made on the loop of each run)
        self.expect = 0

    def snapshot(self, snap: int) -> str:
        return os.path.join(self.snapdir, str(snap))

    def origin_etag(self, key: str) -> str:
        return self.etags.get(key, "")

    def uploaded(self, e: QueueEntry, failed: str) -> None:
        self.finished.append((e.kind, e.key, failed))
        if not failed and e.kind is EntryKind.PUT:
            self.etags[e.key] = e.etag
        if len(self.finished) >= self.expect and self.done is not None:
            self.done.set()

    def reupload(self, copy: QueueEntry, etag: str) -> bool:
        self.reuploads.append((copy.key, etag))
        return self.reupload_answer


def _put(queue: UploadQueue, owner: Owner, key: str, data: bytes) -> QueueEntry:
    snap = queue.reserve_seq()
    with open(owner.snapshot(snap), "wb") as f:
        f.write(data)
    return queue.add(EntryKind.PUT, key, size=len(data), snap=snap)


def _run(config, url: str, queue: UploadQueue, owner: Owner, *, budget: MemoryBudget | None = None) -> None:
    async def go() -> None:
        owner.done = asyncio.Event()
        uploader = Uploader(queue, url, owner, open_object_writes(url, config), open_origin(url, config),
                            writer="test", part_size=5 * MiB, concurrency=4, backoff_max=0.05, budget=budget)
        uploader.start()
        try:
            await asyncio.wait_for(owner.done.wait(), 60)
        finally:
            await uploader.stop()
            await uploader.writes.close()
            await uploader.source.close()

    asyncio.run(go())


def _objects(client, bucket: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def test_entries_finish_in_queue_order_and_the_owner_hears_of_each(s3, config, tmp_path):
    _, client, bucket = s3
    url = f"s3://{bucket}/v"
    queue, owner = UploadQueue(str(tmp_path / "journal")), Owner(str(tmp_path))
    big = os.urandom(2 * 5 * MiB + 123)  # (multipart: three parts, uploaded ahead of their turn)
    _put(queue, owner, "a.bin", b"first")
    _put(queue, owner, "big.bin", big)
    queue.add(EntryKind.COPY, "b.bin", src="a.bin", size=5)
    queue.add(EntryKind.DELETE, "a.bin")
    _put(queue, owner, "marker", b"last")
    owner.expect = 5
    _run(config, url, queue, owner, budget=MemoryBudget(12 * MiB))
    assert owner.finished == [("put", "a.bin", ""), ("put", "big.bin", ""), ("copy", "b.bin", ""),
                              ("delete", "a.bin", ""), ("put", "marker", "")]
    assert _objects(client, bucket) == {"v/big.bin": big, "v/b.bin": b"first", "v/marker": b"last"}
    assert queue.entries == [] and queue.uploaded_bytes == 5 + len(big) + 4
    queue.close()


def test_a_copy_whose_source_was_replaced_asks_the_owner_and_fails_for_good_without_bytes(s3, config, tmp_path):
    _, client, bucket = s3
    url = f"s3://{bucket}/v"
    queue, owner = UploadQueue(str(tmp_path / "journal")), Owner(str(tmp_path))
    _put(queue, owner, "a.bin", b"ours")
    owner.expect = 1
    _run(config, url, queue, owner)
    ours = owner.etags["a.bin"]
    client.put_object(Bucket=bucket, Key="v/a.bin", Body=b"another writer's")  # replaced before our rename's copy
    copy = queue.add(EntryKind.COPY, "b.bin", src="a.bin", size=4)
    owner.expect = 2
    _run(config, url, queue, owner)
    assert owner.reuploads == [("b.bin", ours)]
    assert owner.finished[1][:2] == ("copy", "b.bin") and owner.finished[1][2]
    assert copy.seq in queue.failed
    assert "v/b.bin" not in _objects(client, bucket)
    queue.close()

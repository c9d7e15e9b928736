"""Checkpoint writes without FUSE: the fsspec protocol with ``writable``, ``cachefs sync`` taking over a volume whose
process died, and staged bytes on a cache disk full of read data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import fsspec
import pytest

from cachefs.base.errors import ReadOnlyError
from cachefs.index.volumes import list_volumes
from tests.conftest import put_tree

MiB = 1 << 20


def objects(client, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        out[o["Key"][len(prefix):]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def run(code: str, cache_dir: str, *, check: bool = True) -> subprocess.CompletedProcess:
    """``code`` in a process of its own (a training process, as users run one)."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "CACHEFS_CACHE_DIR": cache_dir, "CACHEFS_CACHE_MIN_FREE": "0",
                            "CACHEFS_CHECKPOINT_PART_SIZE": "5MiB"})
    assert not check or r.returncode == 0, r.stderr
    return r


def test_fsspec_writes_put_pipe_mv_rm_and_reads_back_what_it_wrote(s3, cache_dir):
    _, client, bucket = s3
    client.put_object(Bucket=bucket, Key="ck/old.bin", Body=b"old bytes")
    data = random.Random(1).randbytes(12 * MiB + 3)
    run(f"""
        import fsspec, random
        data = random.Random(1).randbytes({len(data)})
        opts = {{"cachefs": {{"writable": True}}}}
        with fsspec.open("cachefs::s3://{bucket}/ck/model.pt", "wb", **opts) as f:
            f.write(data[:5])
            f.write(data[5:])
        fs = fsspec.filesystem("cachefs", writable=True)
        assert fs.cat("{bucket}/ck/model.pt") == data  # read back from the node, before or after the upload
        fs.pipe("{bucket}/ck/a.txt", b"hello")
        fs.put("/etc/hostname", "{bucket}/ck/host.txt")
        fs.mv("{bucket}/ck/a.txt", "{bucket}/ck/b.txt")      # renamed before its upload: uploaded as b.txt only
        fs.mv("{bucket}/ck/old.bin", "{bucket}/ck/new.bin")  # on the origin already: copied, then deleted
        fs.touch("{bucket}/ck/empty")
        fs.rm("{bucket}/ck/host.txt")
        assert fs.info("{bucket}/ck/model.pt")["size"] == {len(data)}
        # the process ends: it drains its queue first
    """, cache_dir)
    assert objects(client, bucket, "ck/") == {"model.pt": data, "b.txt": b"hello", "new.bin": b"old bytes",
                                              "empty": b""}
    assert list_volumes(cache_dir) == []  # a drained process volume is removed


def test_a_read_only_filesystem_refuses_writes_with_one_clear_error(s3, cache_dir):
    _, _client, bucket = s3
    fs = fsspec.filesystem("cachefs", cache_dir=cache_dir, skip_instance_cache=True)
    for op in (lambda: fs.pipe(f"{bucket}/x", b"1"), lambda: fs.rm(f"{bucket}/x"), lambda: fs.mkdir(f"{bucket}/d"),
               lambda: fs.open(f"{bucket}/x", "wb")):
        with pytest.raises(ReadOnlyError, match="writable"):
            op()


def test_cachefs_sync_finishes_the_uploads_of_a_process_that_died(s3, cache_dir):
    _server, client, bucket = s3
    data = random.Random(2).randbytes(7 * MiB)
    # The writer closes its file (durable), then dies before the upload: the origin is unreachable to it.
    r = run(f"""
        import os, random, fsspec
        fs = fsspec.filesystem("cachefs", writable=True, origin_endpoint_url="http://127.0.0.1:9",
                               origin_max_attempts=1)
        with fs.open("{bucket}/ck/step-1.tmp/w.bin", "wb") as f:
            f.write(random.Random(2).randbytes({len(data)}))
        fs.mv("{bucket}/ck/step-1.tmp", "{bucket}/ck/step-1")
        os._exit(0)  # killed: no drain at exit
    """, cache_dir)
    [vol] = list_volumes(cache_dir)
    assert not vol["owner_alive"] and vol["url"] == f"s3://{bucket}"
    assert objects(client, bucket, "ck/") == {}
    sync = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "sync", f"s3://{bucket}", "--timeout", "60",
                           "--cache-dir", cache_dir], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CACHEFS_CACHE_MIN_FREE": "0"})
    assert sync.returncode == 0, sync.stderr + r.stderr
    got = objects(client, bucket, "ck/")
    assert got.pop("step-1/w.bin") == data
    assert json.loads(got.pop(".cachefs/commits/step-1.json"))["files"][0]["size"] == len(data)
    assert set(got) == {".cachefs/claims/step-1"}


def test_sync_of_a_url_nothing_is_pending_for_succeeds_saying_so(s3, cache_dir):
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "sync", "s3://nobody/here", "--cache-dir",
                        cache_dir], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "nothing pending" in r.stdout and not r.stderr, r.stderr


def test_a_killed_writers_volume_shows_what_waits_syncs_by_any_url_under_it_and_is_done_after(s3, cache_dir):
    """No --cache-dir after the write: the volume's URL names its cache (the writer's engine noted it)."""
    _server, client, bucket = s3
    data = random.Random(3).randbytes(3 * MiB)
    run(f"""
        import os, random, fsspec
        fs = fsspec.filesystem("cachefs", writable=True, origin_endpoint_url="http://127.0.0.1:9",
                               origin_max_attempts=1)
        with fs.open("{bucket}/checkpoints/py-1/w.bin", "wb") as f:
            f.write(random.Random(3).randbytes({len(data)}))
        os._exit(0)  # killed before its exit drain
    """, cache_dir)

    def status() -> tuple[dict, str]:
        js = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--json", "--cache-dir", cache_dir],
                            capture_output=True, text=True, timeout=60)
        text = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--cache-dir", cache_dir],
                              capture_output=True, text=True, timeout=60)
        [vol] = json.loads(js.stdout)["volumes"]
        return vol, text.stdout

    vol, text = status()
    assert not vol["owner_alive"] and not vol["done"]
    assert (vol["staged_bytes"], vol["staged_files"]) == (len(data), 1) and vol["pending"] == ["put checkpoints/py-1/w.bin"]
    assert "staged 3.0 MiB in 1 closed files" in text and "NO OWNER" in text, text
    sync = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "sync", f"s3://{bucket}/checkpoints/py-1",
                           "--timeout", "60"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CACHEFS_CACHE_MIN_FREE": "0"})
    assert sync.returncode == 0, sync.stderr
    assert objects(client, bucket, "checkpoints/") == {"py-1/w.bin": data}
    vol, text = status()
    assert vol["done"] and vol["staged_bytes"] == 0
    assert "done: everything closed there is on the origin" in text and "NO OWNER" not in text, text


@pytest.mark.root
def test_a_checkpoint_arriving_on_a_disk_full_of_read_data_makes_the_read_cache_give_way(s3, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small file system")
    _, client, bucket = s3
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], check=True)
    try:
        cache_dir = str(disk / "cache")
        rng = random.Random(4)
        put_tree(client, bucket, "ds", {f"f{i}.bin": rng.randbytes(4 * MiB) for i in range(10)})
        env = {**os.environ, "CACHEFS_CACHE_MIN_FREE": "2MiB", "CACHEFS_CACHE_CAPACITY": "100%"}
        subprocess.run([sys.executable, "-m", "cachefs.cli.main", "prefetch", f"s3://{bucket}/ds", "-q",
                        "--cache-dir", cache_dir], check=True, timeout=120, env=env)
        free_before = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        assert free_before < 12 * MiB  # the read cache holds the disk
        ckpt = rng.randbytes(20 * MiB)
        run(f"""
            import fsspec, random
            rng = random.Random(4)
            for i in range(10):
                rng.randbytes(4 << 20)
            ckpt = rng.randbytes({len(ckpt)})
            with fsspec.open("cachefs::s3://{bucket}/ck/model.pt", "wb", cachefs={{"writable": True,
                             "cache_min_free": "2MiB", "cache_capacity": "100%"}}) as f:
                for i in range(0, len(ckpt), 1 << 20):
                    f.write(ckpt[i:i + (1 << 20)])
        """, cache_dir)
        assert objects(client, bucket, "ck/") == {"model.pt": ckpt}
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_restart_aborts_the_upload_a_killed_process_began_before_it_heard_the_upload_id(s3, config, tmp_path):
    """The daemon asked for a multipart upload and was killed before the answer: the origin holds an upload whose
    id no journal has. The next process finds it by listing and aborts it; another object's upload stays."""
    import asyncio

    from cachefs.sources import open_object_writes, open_origin
    from cachefs.write.queue import UploadQueue
    from cachefs.write.uploader import Uploader

    _, client, bucket = s3
    url, part = f"s3://{bucket}/ck", 5 * MiB
    data = random.Random(3).randbytes(2 * part + 77)
    journal, snapdir = str(tmp_path / "journal"), tmp_path / "queue"
    snapdir.mkdir()
    dead = UploadQueue(journal)
    e = dead.add("put", "big.pt", size=len(data), snap=dead.reserve_seq())
    (snapdir / str(e.snap)).write_bytes(data)
    dead.multipart_begins(e, "big.pt")
    lost = client.create_multipart_upload(Bucket=bucket, Key="ck/big.pt")["UploadId"]  # the answer never came back
    client.upload_part(Bucket=bucket, Key="ck/big.pt", UploadId=lost, PartNumber=1, Body=data[:part])
    other = client.create_multipart_upload(Bucket=bucket, Key="ck/big.pt.other")["UploadId"]
    # (the process died here: no close)

    async def restart() -> None:
        queue = UploadQueue(journal)
        done = asyncio.Event()
        owner = SimpleNamespace(snapshot=lambda snap: str(snapdir / str(snap)), origin_etag=lambda key: "",
                                uploaded=lambda entry, error: done.set(), reupload=lambda copy, etag: False)
        uploader = Uploader(queue, url, owner, open_object_writes(url, config), open_origin(url, config),
                            writer="test", part_size=part, concurrency=4, backoff_max=0.2)
        uploader.start()
        try:
            await done.wait()
        finally:
            await uploader.stop()
            await uploader.writes.close()
            await uploader.source.close()
            queue.close()

    try:
        asyncio.run(asyncio.wait_for(restart(), 60))
    finally:
        dead.close()
    assert objects(client, bucket, "ck/big.pt") == {"": data}
    left = {(u["Key"], u["UploadId"]) for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
    assert left == {("ck/big.pt.other", other)}

"""Writable checkpoint volumes through a real FUSE mount (root tier): POSIX as checkpoint writers use it, durability
across ``kill -9``, ordered uploads, atomic commits, back-pressure, an origin that stalls and comes back."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tests.integration.test_fuse import Mounted, stopped_origin  # noqa: F401 - a fixture

pytestmark = pytest.mark.root

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse (CI runs as root)", allow_module_level=True)

MiB = 1 << 20
ENV = {"CACHEFS_CHECKPOINT_PART_SIZE": "5MiB", "CACHEFS_ORIGIN_MAX_ATTEMPTS": "3"}


def cli(cache_dir: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachefs.cli.main", *args, "--cache-dir", cache_dir],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **ENV})


class Body(bytes):
    """An object's bytes, shown by size and digest (a failed comparison of megabytes stays readable, and fast)."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes {hashlib.sha256(self).hexdigest()[:12]} {bytes(self[:8])!r}…>"


def objects(client, bucket: str, prefix: str = "ck/") -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix):]] = Body(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
    return out


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture
def volume(s3, cache_dir, tmp_path):
    _, client, bucket = s3
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, f"s3://{bucket}/ck", str(mnt), "--writable", env=ENV)
    try:
        yield m, client, bucket
    finally:
        m.close()


def sync(m: Mounted, timeout: float = 60) -> None:
    r = cli(m.cache_dir, "sync", m.mountpoint, "--timeout", str(timeout))
    assert r.returncode == 0, r.stderr


def test_posix_operations_of_checkpoint_writers_and_every_byte_on_the_origin(volume, tmp_path):
    m, client, bucket = volume
    rng = random.Random(3)
    big = rng.randbytes(12 * MiB + 17)
    # create, write at any offset (sparse too), read back before the upload
    with open(m.path("model.pt"), "wb") as f:
        f.write(big[:MiB])
        f.seek(8 * MiB)
        f.write(big[8 * MiB:])
        f.seek(MiB)
        f.write(big[MiB:8 * MiB])
        f.flush()
        os.fsync(f.fileno())
    with open(m.path("model.pt"), "rb") as f:
        assert f.read() == big
    # truncate, append, mkdir, rename files and directories, unlink, rmdir, readdir, stat
    write(m.path("t.bin"), b"0123456789")
    os.truncate(m.path("t.bin"), 4)
    with open(m.path("t.bin"), "ab") as f:
        f.write(b"xy")
    os.makedirs(m.path("run/step-1.tmp/shards"))
    write(m.path("run/step-1.tmp/shards/0"), b"zero")
    write(m.path("run/step-1.tmp/meta.json.tmp"), b"{}")
    os.rename(m.path("run/step-1.tmp/meta.json.tmp"), m.path("run/step-1.tmp/meta.json"))
    os.rename(m.path("run/step-1.tmp"), m.path("run/step-1"))
    write(m.path("gone.txt"), b"bye")
    os.unlink(m.path("gone.txt"))
    os.mkdir(m.path("empty"))
    os.rmdir(m.path("empty"))
    assert sorted(os.listdir(m.path(""))) == ["model.pt", "run", "t.bin"]
    assert os.stat(m.path("model.pt")).st_size == len(big) and os.stat(m.path("model.pt")).st_nlink == 1
    # links get a clear errno
    for make in (lambda: os.link(m.path("t.bin"), m.path("hard")), lambda: os.symlink("t.bin", m.path("soft"))):
        with pytest.raises(OSError) as exc:
            make()
        assert exc.value.errno == errno.EPERM
    # shutil.copytree (HF, Lightning) into the volume
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "w.bin").write_bytes(rng.randbytes(300_000))
    (src / "config.json").write_text('{"a": 1}')
    shutil.copytree(src, m.path("hf"))
    sync(m)
    got = objects(client, bucket)
    assert got.pop("model.pt") == big
    assert got.pop("t.bin") == b"0123xy"
    assert got.pop("run/step-1/shards/0") == b"zero" and got.pop("run/step-1/meta.json") == b"{}"
    assert got.pop("hf/sub/w.bin") == (src / "sub" / "w.bin").read_bytes()
    assert got.pop("hf/config.json") == b'{"a": 1}'
    record = json.loads(got.pop("run/.cachefs/commits/step-1.json"))  # D.tmp → D committed the directory
    assert sorted(f["path"] for f in record["files"]) == ["meta.json", "shards/0"]
    assert got.pop("run/.cachefs/claims/step-1")
    assert got == {}  # nothing under .tmp names, nothing unlinked, nothing else
    # read back after the upload, from this node
    with open(m.path("model.pt"), "rb") as f:
        assert f.read() == big


def test_a_bucket_reader_never_sees_a_partial_checkpoint_and_files_land_in_close_order(volume, stopped_origin):  # noqa: F811
    m, client, bucket = volume
    rng = random.Random(5)
    shards = {f"step-2/__{i}_0.distcp": rng.randbytes(rng.choice([3 * MiB, 7 * MiB])) for i in range(6)}
    snapshots: list[set[str]] = []
    stop = threading.Event()

    def watch() -> None:  # a reader of the bucket, listing as fast as it can
        while not stop.is_set():
            resp = client.list_objects_v2(Bucket=bucket, Prefix="ck/")
            snapshots.append({o["Key"][3:] for o in resp.get("Contents", [])})

    stopped_origin.stop()  # everything queues up first, so that the uploads could overtake each other
    try:
        os.mkdir(m.path("step-2"))
        for name, data in shards.items():  # DCP: the shards, then .metadata by rename
            write(m.path(name), data)
        write(m.path("step-2/.metadata.tmp"), b"metadata")
        os.rename(m.path("step-2/.metadata.tmp"), m.path("step-2/.metadata"))
    finally:
        stopped_origin.resume()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        sync(m)
    finally:
        stop.set()
        watcher.join()
    order = [*shards, "step-2/.metadata", ".cachefs/commits/step-2.json"]
    for seen in snapshots:
        present = [k in seen for k in order]
        assert present == sorted(present, reverse=True), f"landed out of order: {sorted(seen)}"
    assert any(".cachefs/commits/step-2.json" in s for s in snapshots)
    r = cli(m.cache_dir, "checkpoints", f"s3://{bucket}/ck", "--json")
    [record] = json.loads(r.stdout)
    assert record["name"] == "step-2" and record["bytes"] == sum(map(len, shards.values())) + len(b"metadata")
    assert objects(client, bucket, "ck/step-2/") == {k[len("step-2/"):]: v for k, v in
                                                     {**shards, "step-2/.metadata": b"metadata"}.items()}


def test_kill_9_of_the_daemon_after_close_loses_nothing(volume, stopped_origin):  # noqa: F811
    m, client, bucket = volume
    first = m.wait_for_daemon()
    data = random.Random(7).randbytes(9 * MiB)
    stopped_origin.stop()  # the upload cannot start
    try:
        write(m.path("ckpt.pt"), data)  # close returned: durable on this node
        os.kill(first["pid"], signal.SIGKILL)
    finally:
        stopped_origin.resume()
    m.wait_for_daemon(other_than=first["pid"])
    sync(m)
    assert objects(client, bucket) == {"ckpt.pt": data}
    with open(m.path("ckpt.pt"), "rb") as f:  # the kernel's inode, served by the new daemon
        assert f.read() == data


def test_kill_9_of_the_daemon_between_the_writes_and_the_close_loses_nothing(volume):
    """Every byte written while one daemon served, the file closed after the next took over: its close is the one
    that queues the upload (the next daemon counted the handle it had not opened clean, and the file never went
    up; nor did the checkpoint directory it was renamed with)."""
    m, client, bucket = volume
    first = m.wait_for_daemon()
    data = random.Random(8).randbytes(3 * MiB + 5)
    os.mkdir(m.path("step-1.tmp"))
    with open(m.path("step-1.tmp/model.pt"), "wb") as f:
        f.write(data)
        f.flush()  # (the WRITEs answered by the first daemon; no close yet)
        os.kill(first["pid"], signal.SIGKILL)
        m.wait_for_daemon(other_than=first["pid"])
    os.rename(m.path("step-1.tmp"), m.path("step-1"))
    sync(m)
    assert objects(client, bucket, "ck/step-1/") == {"model.pt": data}


def test_kill_9_during_a_multipart_upload_resumes_it_whole(volume, stopped_origin):  # noqa: F811
    m, client, bucket = volume
    first = m.wait_for_daemon()
    data = random.Random(11).randbytes(60 * MiB)
    write(m.path("big.pt"), data)
    deadline = time.monotonic() + 30
    while not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
        assert time.monotonic() < deadline, "no multipart upload began"
        time.sleep(0.005)
    stopped_origin.stop()  # parts are going up: freeze the origin, then kill the daemon mid-upload
    try:
        os.kill(first["pid"], signal.SIGKILL)
    finally:
        stopped_origin.resume()
    m.wait_for_daemon(other_than=first["pid"])
    sync(m)
    assert objects(client, bucket, "ck/big.pt")[""] == data
    # The restarted daemon aborted the dead one's upload, even when it died before it heard the upload's id.
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_writers_wait_past_the_staging_limit_while_the_origin_stalls_and_finish_when_it_returns(
        s3, cache_dir, tmp_path, stopped_origin):  # noqa: F811
    _, client, bucket = s3
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, f"s3://{bucket}/ck", str(mnt), "--writable",
                env={**ENV, "CACHEFS_CHECKPOINT_STAGING_LIMIT": "12MiB", "CACHEFS_ORIGIN_REQUEST_TIMEOUT": "2"})
    try:
        rng = random.Random(13)
        files = {f"s{i}.bin": rng.randbytes(5 * MiB) for i in range(4)}
        stopped_origin.stop()
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                for name, data in files.items():
                    write(m.path(name), data)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        t = threading.Thread(target=writer)
        t.start()
        vdir_status = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the writer is held back, not failed
            st = json.loads(cli(cache_dir, "status", "--json").stdout)
            vdir_status = st["volumes"][0]
            if vdir_status.get("writers_waiting"):
                break
            time.sleep(0.2)
        assert vdir_status and vdir_status["writers_waiting"] >= 1 and t.is_alive() and not errors
        assert vdir_status["staged_bytes"] <= 12 * MiB + MiB
        while time.monotonic() < deadline:  # the stalled upload times out, shows in status, and is retried
            failing = json.loads(cli(cache_dir, "status", "--json").stdout)["volumes"][0]
            if failing.get("last_error"):
                break
            time.sleep(0.5)
        assert failing["last_error"] and "timed out" in failing["last_error"]
        stopped_origin.resume()
        t.join(120)
        assert not t.is_alive() and not errors
        sync(m)
        st = json.loads(cli(cache_dir, "status", "--json").stdout)["volumes"][0]
        assert st["failures"] >= 1 and st["last_error"] == "" and st["staged_bytes"] == 0
        assert objects(client, bucket) == files
    finally:
        stopped_origin.resume()
        m.close()


def test_two_writers_racing_on_one_checkpoint_one_wins_and_nothing_mixes(s3, cache_dir, tmp_path):
    _, client, bucket = s3
    mounts = []
    try:
        for i in range(2):  # two nodes' volumes over the same prefix (two cache directories)
            mnt = tmp_path / f"mnt{i}"
            mnt.mkdir()
            mounts.append(Mounted(f"{cache_dir}-{i}", f"s3://{bucket}/ck", str(mnt), "--writable", "-v", env=ENV))
        payloads = []
        for i, m in enumerate(mounts):
            data = {"a": bytes([i]) * 300_000, "b": bytes([i + 10]) * 200_000}
            payloads.append(data)
            os.mkdir(m.path("step-9.tmp"))
            for name, body in data.items():
                write(m.path(f"step-9.tmp/{name}"), body)
        for m in mounts:
            os.rename(m.path("step-9.tmp"), m.path("step-9"))
        results = [cli(m.cache_dir, "sync", m.mountpoint, "--timeout", "60") for m in mounts]

        def evidence() -> str:  # (a race: what each writer said and logged, should it ever fail again)
            return "\n".join(f"writer {i}: sync rc {r.returncode} {r.stderr!r}\n{m.read_output()[-4000:]}"
                             for i, (r, m) in enumerate(zip(results, mounts, strict=True)))

        assert sorted(r.returncode for r in results) == [0, 1], evidence()
        loser = next(r for r in results if r.returncode == 1)
        assert "committed by another writer" in loser.stderr
        winner = payloads[[r.returncode for r in results].index(0)]
        got = objects(client, bucket, "ck/step-9/")
        assert got == {k: Body(v) for k, v in winner.items()}, evidence()  # the loser wrote none of its objects
        record = json.loads(objects(client, bucket, "ck/.cachefs/commits/")["step-9.json"])
        assert {f["path"]: f["size"] for f in record["files"]} == {k: len(v) for k, v in winner.items()}
    finally:
        for m in mounts:
            m.close()


def test_a_rename_after_the_upload_copies_this_writers_object_not_anothers_of_the_same_name(s3, cache_dir, tmp_path):
    """Two writers used one temporary name on the origin; the one that renames it after both uploads publishes its
    own bytes (its copy is pinned to the ETag it uploaded; the other's object is not copied)."""
    _, client, bucket = s3
    mounts = []
    try:
        for i in range(2):
            mnt = tmp_path / f"mnt{i}"
            mnt.mkdir()
            mounts.append(Mounted(f"{cache_dir}-{i}", f"s3://{bucket}/ck", str(mnt), "--writable", "-v", env=ENV))
        mine, theirs = (Body(bytes([i]) * 100_000) for i in (7, 8))
        for m, body in zip(mounts, (mine, theirs), strict=True):
            os.mkdir(m.path("step-3.tmp"))
            write(m.path("step-3.tmp/model"), body)
            sync(m)  # on the origin as ck/step-3.tmp/model; the second writer's replaced the first's
        assert objects(client, bucket, "ck/step-3.tmp/") == {"model": theirs}
        os.rename(mounts[0].path("step-3.tmp"), mounts[0].path("step-3"))
        sync(mounts[0])
        assert objects(client, bucket, "ck/step-3/") == {"model": mine}
        record = json.loads(objects(client, bucket, "ck/.cachefs/commits/")["step-3.json"])
        assert [(f["path"], f["size"]) for f in record["files"]] == [("model", len(mine))]
    finally:
        for m in mounts:
            m.close()


def test_only_the_mounting_user_reaches_a_writable_mount(volume):
    m, _client, _bucket = volume
    write(m.path("mine.txt"), b"x")
    probe = ("import os, sys\nos.setgid(65534); os.setuid(65534)\n"
             "for op in (lambda: os.listdir(sys.argv[1]), lambda: open(sys.argv[1] + '/new', 'wb')):\n"
             "    try:\n        op(); print('allowed')\n    except PermissionError:\n        print('refused')\n")
    r = subprocess.run([sys.executable, "-c", probe, m.mountpoint], capture_output=True, text=True, timeout=30)
    assert r.stdout.split() == ["refused", "refused"], r.stderr


def test_files_made_in_a_group_volume_belong_to_the_group_whoever_makes_them(s3, cache_dir, tmp_path):
    """A volume published for a pod's fsGroup (``--group``; the top is setgid 2775): what any member makes in it
    belongs to the group, as in any setgid directory, not to the maker's primary group (found on a real node: a pod
    running as user 1000 with fsGroup 1000 made a checkpoint directory of group root), with the modes its umask
    gives (the daemon's own umask took the group's write bit)."""
    _, _client, bucket = s3
    mnt = tempfile.mkdtemp(prefix="cachefs-group-")  # (pytest's tmp_path is root's alone: 1234 could not reach it)
    os.chmod(mnt, 0o755)
    m = Mounted(cache_dir, f"s3://{bucket}/ck", mnt, "--writable", "--group", "4242", "--allow-other", env=ENV)
    try:
        writer = ("import os, sys\nos.setgroups([4242]); os.setgid(777); os.setuid(1234); os.umask(0o002)\n"
                  "os.mkdir(sys.argv[1] + '/step.tmp')\nopen(sys.argv[1] + '/step.tmp/shard', 'wb').write(b'x')\n"
                  "os.mkdir(sys.argv[1] + '/step.tmp/sub')\n")
        r = subprocess.run([sys.executable, "-c", writer, m.mountpoint], capture_output=True, text=True, timeout=30)
        if r.returncode != 0 and os.path.lexists(m.path("step.tmp")):  # (what the volume made, as the tree has it)
            st = os.stat(m.path("step.tmp"))
            seen = f"step.tmp: mode {oct(st.st_mode)} uid {st.st_uid} gid {st.st_gid}"
        else:
            seen = ""
        assert r.returncode == 0, (r.stderr, seen, m.read_output()[-2000:])
        for rel in ("step.tmp", "step.tmp/shard", "step.tmp/sub"):
            st = os.stat(m.path(rel))
            assert (st.st_uid, st.st_gid) == (1234, 4242), rel
        # The maker's umask (002: its group may write) and nothing else decides the modes; directories stay setgid.
        for rel in ("step.tmp", "step.tmp/sub"):
            assert stat.S_IMODE(os.stat(m.path(rel)).st_mode) == 0o2775, rel
        assert stat.S_IMODE(os.stat(m.path("step.tmp/shard")).st_mode) == 0o664
    finally:
        m.close()
        os.rmdir(mnt)


def test_a_mount_point_names_its_cache_for_sync_status_and_umount(s3, cache_dir, tmp_path):
    """Made with --cache-dir; then sync, status and umount are given the mount point only (issue 48, items 1, 9)."""
    _, client, bucket = s3
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, f"s3://{bucket}/ck", str(mnt), "--writable", env=ENV)

    def plain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cachefs.cli.main", *args], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **ENV})

    try:
        first, second = os.urandom(300_000), os.urandom(200_000)
        write(m.path("a.bin"), first)
        r = plain("sync", m.mountpoint, "--timeout", "60")
        assert r.returncode == 0, r.stderr
        assert objects(client, bucket) == {"a.bin": first}
        r = plain("status", m.mountpoint)
        assert r.returncode == 0 and f"cache dir  {cache_dir}" in r.stdout and m.mountpoint in r.stdout, r.stdout
        write(m.path("b.bin"), second)
        r = plain("umount", m.mountpoint)  # (its uploads are waited for first, in the mount's own cache)
        assert r.returncode == 0, r.stderr
        assert objects(client, bucket) == {"a.bin": first, "b.bin": second}
    finally:
        m.close()

"""The FUSE mount, for real: /dev/fuse, mount(2), the kernel as the client (root tier)."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cachefs.fuse import unmount
from cachefs.index.mounts import list_mounts
from cachefs.testing.s3server import S3Server
from tests.conftest import make_files, put_tree

pytestmark = pytest.mark.root

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse (CI runs as root)", allow_module_level=True)


class Mounted:
    """``cachefs mount --foreground`` in its own process, as users run it (a server sharing a process with
    its clients can deadlock on mmap faults, as every FUSE server can)."""

    def __init__(self, cache_dir: str, url: str, mountpoint: str, *extra: str, env: dict | None = None) -> None:
        self.mountpoint, self.cache_dir, self.url = mountpoint, cache_dir, url
        env = {**os.environ, "CACHEFS_ORIGIN_REQUEST_TIMEOUT": "3", "CACHEFS_ORIGIN_BACKOFF_MAX": "0.05",
               **(env or {})}
        # (Its output goes to a file: a pipe nobody reads while the test runs would stop a chatty daemon.)
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "mount", "--foreground", url,
                                      mountpoint, "--cache-dir", cache_dir, *extra], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (self.record() or {}).get("pid"):
            assert self.proc.poll() is None, self.read_output()
            assert time.monotonic() < deadline, "mount did not come up"
            time.sleep(0.1)

    def wait_for_daemon(self, other_than: int = 0) -> dict:
        """The mount record of a serving daemon (other than pid ``other_than``)."""
        deadline = time.monotonic() + 60
        while True:
            rec = self.record()
            if rec and rec["pid"] and rec["pid"] != other_than:
                return rec
            assert time.monotonic() < deadline, "no daemon took over the mount"
            time.sleep(0.05)

    def record(self) -> dict | None:
        return next((m for m in list_mounts(self.cache_dir) if m["mountpoint"] == self.mountpoint), None)

    def stats(self) -> dict:
        time.sleep(1.2)  # the daemon refreshes its record every second
        return self.record()["stats"]

    def path(self, rel: str) -> str:
        return os.path.join(self.mountpoint, rel)

    def read_output(self) -> str:
        """What the holder and its daemons printed so far (their logs)."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            unmount(self.mountpoint)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                for pid in {self.proc.pid, (self.record() or {}).get("pid")} - {None}:
                    os.kill(pid, signal.SIGUSR1)  # every thread's stack into the output (cachefs.cli.main)
                time.sleep(1)
                self.proc.kill()
                raise AssertionError(f"FUSE daemon did not exit after unmount: {self.read_output()[-6000:]}") from None
        if not self._log.closed:
            #: What the holder and its daemons printed (their logs).
            self.output = self.read_output()
            self._log.close()


@pytest.fixture
def mounted(s3, cache_dir, tmp_path):
    _, client, bucket = s3
    files = make_files(n_small=60, big_sizes=(3_000_000, 700_001))
    put_tree(client, bucket, "ds", files)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, f"s3://{bucket}/ds", str(mnt))
    try:
        yield m, files
    finally:
        m.close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_every_file_reads_back_byte_for_byte_large_ones_by_passthrough_packed_ones_from_page_cache(mounted):
    m, files = mounted
    for rel, data in files.items():
        with open(m.path(rel), "rb") as f:
            assert f.read() == data, rel
    assert m.record()["mode"] == "passthrough"
    assert m.record()["opens_skipped"] is False  # large files: their opens answer with a backing file
    large = [rel for rel, data in files.items() if len(data) > 1024 * 1024]  # over the default pack threshold
    before = m.stats()
    for rel, data in files.items():  # cached now: large files by passthrough, packed ones through the page cache
        with open(m.path(rel), "rb") as f:
            assert f.read() == data, rel
    stats = m.stats()
    assert large and stats["passthrough_opens"] - before["passthrough_opens"] == len(large)
    # Every packed file is opened so that the kernel keeps its pages (a read of a cached page then never reaches
    # the daemon). Which pages the kernel still holds is its own business (this VM pages out memory it sees as
    # cold), so how many bytes that kept from Python is measured in bench/fuse_bench.py, not asserted here.
    assert stats["page_cache_opens"] - before["page_cache_opens"] == len(files) - len(large)
    assert stats["userspace_opens"] - before["userspace_opens"] == len(files) - len(large)


def test_status_counts_what_the_kernel_reads_by_passthrough(mounted):
    """A warm read through the mount, whose large files the kernel reads itself (passthrough), shows as hits in
    `cachefs status`: each passthrough open counts as an access of the whole file (the daemon never sees those
    reads), so the hit ratio is not 0 % and two-touch eviction sees the file used again."""
    m, files = mounted
    for _ in range(2):
        for rel, data in files.items():
            with open(m.path(rel), "rb") as f:
                assert f.read() == data, rel
    large = sum(len(d) for d in files.values() if len(d) > 1024 * 1024)
    deadline = time.monotonic() + 30
    while True:  # (the daemon writes its statistics to the index every couple of seconds)
        r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--json", "--cache-dir", m.cache_dir],
                           capture_output=True, text=True, timeout=60)
        rep = json.loads(r.stdout)
        if rep["datasets"] and rep["datasets"][0]["hit_bytes"] >= large:
            break
        assert time.monotonic() < deadline, rep["datasets"]
        time.sleep(0.2)
    assert rep["tier_bytes"]["local"] >= large and rep["tier_bytes"]["origin"] >= sum(map(len, files.values()))
    table = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--cache-dir", m.cache_dir],
                           capture_output=True, text=True, timeout=60).stdout
    hit_ratio = table.splitlines()[-1].split()[-3]  # (then the policy and the epoch hit ratios)
    assert hit_ratio not in ("0.0%", "-"), table


def test_a_packed_file_is_in_the_page_cache_when_its_first_open_returns(mounted):
    """On a warm cache, a packed small file's bytes are stored into the kernel's page cache before its first open
    is answered (FUSE_NOTIFY_STORE), so reading it costs no READ request; with ``--no-prefill`` its reads come
    through userspace as before. Either way the bytes are the origin's."""
    m, files = mounted
    for rel, data in files.items():
        with open(m.path(rel), "rb") as f:
            assert f.read() == data, rel
    m.stats()
    time.sleep(1.0)  # pending packs are written a second after their last member
    m.close()
    packed = sum(len(d) for d in files.values() if len(d) <= 1024 * 1024)
    assert packed
    for extra, stored in (((), True), (("--no-prefill",), False)):
        again = Mounted(m.cache_dir, m.url, m.mountpoint, *extra)
        try:
            for rel, data in files.items():
                with open(again.path(rel), "rb") as f:
                    assert f.read() == data, rel
            stats = again.stats()
        finally:
            again.close()
        if stored:
            assert stats.get("prefilled_bytes") == packed and stats["userspace_read_bytes"] == 0, stats
        else:
            assert not stats.get("prefilled_bytes") and stats["userspace_read_bytes"] >= packed, stats


def test_opens_stop_once_every_file_is_a_packed_small_file_on_this_node(s3, cache_dir, tmp_path):
    """A dataset of small files only. While some are not on this node the kernel's opens are answered (an
    uncached file opens direct-I/O in passthrough mode, so that a read waiting on the origin can be
    interrupted); once all are, OPEN is answered ENOSYS and the kernel opens files without asking, so a file in
    the page cache costs no request at all. Packs that are not in the page cache are read off the request
    thread, with the same bytes. With ``--keep-opens`` every open is answered."""
    _, client, bucket = s3
    files = make_files(n_small=60, big_sizes=(400_000,), seed=4)
    put_tree(client, bucket, "ds", files)
    url = f"s3://{bucket}/ds"
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def read_all(m: Mounted) -> None:
        for rel, data in files.items():
            with open(m.path(rel), "rb") as f:
                assert f.read() == data, rel

    m = Mounted(cache_dir, url, str(mnt))
    try:
        assert m.stats()["opens_refused"] == 0 and m.record()["opens_skipped"] is False  # nothing cached yet
        read_all(m)  # fetches and packs every file
        assert m.stats()["userspace_opens"] == len(files)
        deadline = time.monotonic() + 30
        while not m.record()["opens_skipped"]:
            assert time.monotonic() < deadline, "opens were not skipped once every file was on this node"
            time.sleep(0.2)
        for _ in range(2):  # the first pass puts the pages into the page cache through READ
            read_all(m)
        stats = m.stats()
        # Not one more open was answered (the one that switched the kernel over was refused). How many READs the
        # page cache then saves is the kernel's business (this VM pages out memory it sees as cold): measured in
        # bench/fuse_bench.py, not asserted here.
        assert stats["userspace_opens"] == len(files)
        assert stats["opens_refused"] == 1

        # Many readers of one packed file at once, its pages dropped under them: the READs share the inode's
        # read state (no open file of their own) and still get the right bytes.
        big = files["big/0.bin"]
        errors: list[str] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            fd = os.open(m.path("big/0.bin"), os.O_RDONLY)
            try:
                for _ in range(40):
                    if rng.random() < 0.3:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    off, n = rng.randrange(len(big)), rng.randrange(1, 200_000)
                    if os.pread(fd, n, off) != big[off:off + n]:
                        errors.append(f"{off}+{n}")
            finally:
                os.close(fd)
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads), errors

        # A restarted daemon knows the kernel opens without asking, and serves READs that name no handle.
        first = m.wait_for_daemon()
        os.kill(first["pid"], signal.SIGKILL)
        second = m.wait_for_daemon(other_than=first["pid"])
        assert second["opens_skipped"] is True
        for rel in files:
            with open(m.path(rel), "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        read_all(m)
        stats = m.stats()
        assert stats["userspace_opens"] == 0 and stats["userspace_read_bytes"] > 0, stats
    finally:
        m.close()

    packs = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(cache_dir, "packs")) for n in names]
    assert packs
    for p in packs:  # out of the page cache: reading a member now waits on the disk
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    for extra, skipped in (((), True), (("--keep-opens",), False)):
        again = Mounted(cache_dir, url, str(mnt), *extra)
        try:
            time.sleep(0.3)  # (the first check runs as the mount comes up)
            read_all(again)
            stats = again.stats()
            assert again.record()["opens_skipped"] is skipped
            assert (stats["userspace_opens"] == 0) is skipped and (stats["opens_refused"] == 1) is skipped
            if skipped:
                assert stats["disk_waits"] >= 1, stats  # answered after the device was handed on
        finally:
            again.close()


def test_reads_of_a_warm_mount_reach_the_index_while_it_is_mounted(s3, cache_dir, tmp_path):
    """Hits served from local data (no fetch ever reaches the event loop) are flushed to the index as they
    happen, so `cachefs status` shows a hot directory while the mount is up, not after it ends."""
    _, client, bucket = s3
    files = make_files(n_small=30, big_sizes=(), seed=6)
    put_tree(client, bucket, "ds", files)
    url = f"s3://{bucket}/ds"
    cli = [sys.executable, "-m", "cachefs.cli.main"]
    subprocess.run([*cli, "prefetch", url, "-q", "--cache-dir", cache_dir], check=True, timeout=120)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, url, str(mnt), "--keep-opens")
    try:
        hot = [rel for rel in files if rel.startswith("small/d1/")]
        for _ in range(3):
            for rel in hot:
                with open(m.path(rel), "rb", buffering=0) as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # so the read reaches the daemon
                    assert f.read() == files[rel]
        deadline = time.monotonic() + 20
        while True:
            out = subprocess.run([*cli, "status", "--json", "--cache-dir", cache_dir], capture_output=True,
                                 text=True, timeout=60, check=True).stdout
            dirs = json.loads(out)["hot_directories"]
            if dirs and dirs[0]["path"] == "small/d1":
                break
            assert time.monotonic() < deadline, dirs
            time.sleep(0.5)
    finally:
        m.close()


def test_tree_metadata_walk_ls_find_stat(mounted):
    m, files = mounted
    seen = set()
    for root, _dirs, names in os.walk(m.mountpoint):
        for n in names:
            seen.add(os.path.relpath(os.path.join(root, n), m.mountpoint))
    assert seen == set(files)
    for rel, data in files.items():
        st = os.stat(m.path(rel))
        assert st.st_size == len(data) and st.st_mode & 0o777 == 0o444
    out = subprocess.run(["ls", "-l", m.path("big")], capture_output=True, text=True, check=True).stdout
    assert "3000000" in out and "700001" in out
    found = subprocess.run(["find", m.mountpoint, "-type", "f"], capture_output=True, text=True, check=True).stdout
    assert len(found.split()) == len(files)
    with pytest.raises(FileNotFoundError):
        os.stat(m.path("nope"))
    assert os.statvfs(m.mountpoint).f_files == len(files)


def test_odd_offsets_mmap_and_many_readers_on_one_file(mounted):
    m, files = mounted
    data = files["big/0.bin"]
    rng = random.Random(5)
    fd = os.open(m.path("big/0.bin"), os.O_RDONLY)  # first open: not cached yet, userspace reads
    try:
        for _ in range(300):
            off = rng.randrange(0, len(data) + 200)
            n = rng.choice([1, 7, 511, 4095, 4097, 65537, rng.randrange(1, 300_000)])
            assert os.pread(fd, n, off) == data[off:off + n]
    finally:
        os.close(fd)

    def reader(i: int) -> bool:
        with open(m.path("big/0.bin"), "rb") as f:
            f.seek(i * 1000)
            return f.read() == data[i * 1000:]

    with ThreadPoolExecutor(12) as pool:
        assert all(pool.map(reader, range(24)))
    with open(m.path("big/1.bin"), "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert sha(mm[:]) == sha(files["big/1.bin"])


def test_writes_are_refused_with_erofs(mounted):
    m, _ = mounted
    for action in (lambda: open(m.path("new"), "w"), lambda: os.mkdir(m.path("d")),
                   lambda: os.unlink(m.path("big/0.bin")), lambda: open(m.path("big/0.bin"), "r+b")):
        with pytest.raises(OSError) as exc:
            action()
        assert exc.value.errno == errno.EROFS


def test_fio_sequential_and_random_reads(mounted):
    if shutil.which("fio") is None:
        pytest.skip("fio not installed (.ci/run installs it)")
    m, _ = mounted
    for rw in ("read", "randread"):
        out = subprocess.run(["fio", "--name=t", f"--filename={m.path('big/0.bin')}", f"--rw={rw}", "--bs=64k",
                              "--size=3000000", "--readonly", "--verify=0", "--output-format=terse"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        fields = out.stdout.strip().split(";")
        assert int(fields[5]) > 0  # read KiB transferred


def test_origin_down_cached_files_read_uncached_fail_fast(cache_dir, tmp_path, monkeypatch):
    with S3Server() as server:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        client = server.client()
        client.create_bucket(Bucket="down")
        files = make_files(n_small=10, big_sizes=(200_000,))
        put_tree(client, "down", "ds", files)
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        m = Mounted(cache_dir, "s3://down/ds", str(mnt))
        try:
            cached = "big/0.bin"
            with open(m.path(cached), "rb") as f:
                assert f.read() == files[cached]
            server.stop()
            with open(m.path(cached), "rb") as f:
                assert f.read() == files[cached]
            uncached = next(p for p, d in files.items() if p.startswith("small/") and d)
            t = time.monotonic()
            with pytest.raises(OSError) as exc, open(m.path(uncached), "rb") as f:
                f.read()
            assert exc.value.errno == errno.EIO and time.monotonic() - t < 60
        finally:
            m.close()


def test_unmount_while_readers_are_busy(mounted):
    m, files = mounted
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader():
        while not stop.is_set():
            try:
                with open(m.path("big/0.bin"), "rb") as f:
                    assert f.read() == files["big/0.bin"]
            except OSError:
                return  # the mount went away under us: an error, never wrong bytes or a hang
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    unmount(m.mountpoint)
    stop.set()
    for t in threads:
        t.join(20)
        assert not t.is_alive()
    assert not errors
    m.proc.wait(15)  # the daemon exits once the kernel lets go


def test_walk_of_a_20000_file_tree_matches_the_origin(tmp_path, cache_dir):
    src = tmp_path / "src"
    expected = set()
    for d in range(40):
        (src / f"class{d:02d}").mkdir(parents=True)
        for i in range(500):
            rel = f"class{d:02d}/img{i:04d}.jpg"
            (src / rel).write_bytes(b"x" * (i % 7))
            expected.add(rel)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, f"file://{src}", str(mnt))
    try:
        seen, sizes = set(), 0
        for root, _dirs, names in os.walk(m.mountpoint):
            for n in names:
                p = os.path.join(root, n)
                seen.add(os.path.relpath(p, m.mountpoint))
                sizes += os.stat(p).st_size
        assert seen == expected
        assert sizes == sum(i % 7 for i in range(500)) * 40
    finally:
        m.close()


@pytest.fixture
def stopped_origin(s3):
    """``stop()`` freezes the S3 server (SIGSTOP: connections hang, as with a stalled origin), ``resume()``
    thaws it; always thawed at the end."""
    server = s3[0]

    class Origin:
        def stop(self) -> None:
            server.proc.send_signal(signal.SIGSTOP)

        def resume(self) -> None:
            server.proc.send_signal(signal.SIGCONT)

    o = Origin()
    try:
        yield o
    finally:
        o.resume()


def test_daemon_killed_mid_read_is_restarted_and_readers_never_notice(s3, cache_dir, tmp_path, stopped_origin):
    _, client, bucket = s3
    rng = random.Random(9)
    files = {"big/a.bin": rng.randbytes(16 << 20), "big/b.bin": rng.randbytes(4 << 20)}
    files.update({f"small/f{i}.txt": rng.randbytes(rng.randint(1, 9000)) for i in range(50)})
    put_tree(client, bucket, "ds", files)
    url = f"s3://{bucket}/ds"
    subprocess.run([sys.executable, "-m", "cachefs.cli.main", "prefetch", url, "--include", "big/b.bin", "-q",
                    "--cache-dir", cache_dir], check=True, timeout=120)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, url, str(mnt), env={"CACHEFS_ORIGIN_REQUEST_TIMEOUT": "30"})
    fd_a = fd_b = -1
    try:
        first = m.wait_for_daemon()
        a, b = files["big/a.bin"], files["big/b.bin"]
        fd_a = os.open(m.path("big/a.bin"), os.O_RDONLY)  # not cached: userspace reads
        fd_b = os.open(m.path("big/b.bin"), os.O_RDONLY)  # cached: passthrough
        assert os.pread(fd_a, 1 << 18, 0) == a[:1 << 18]
        assert os.pread(fd_b, 1 << 20, 0) == b[:1 << 20]
        for rel in list(files)[2:20]:  # inodes the kernel keeps (dentry cache) across the restart
            assert os.stat(m.path(rel)).st_size == len(files[rel])

        # A read the daemon has taken but cannot answer yet (the origin hangs) when it is SIGKILLed. (At 12 MiB:
        # the engine's read-ahead after the first read fetches the 4 MiB block after it, nothing further.)
        stopped_origin.stop()
        result: dict = {}
        blocked = threading.Thread(target=lambda: result.setdefault("data", os.pread(fd_a, 1 << 20, 12 << 20)))
        blocked.start()
        time.sleep(1.0)
        assert blocked.is_alive()
        os.kill(first["pid"], signal.SIGKILL)
        stopped_origin.resume()
        second = m.wait_for_daemon(other_than=first["pid"])
        blocked.join(60)
        assert not blocked.is_alive() and result["data"] == a[12 << 20:13 << 20]

        # Both open handles keep working, the rest of the tree too; no ENOTCONN anywhere.
        assert os.pread(fd_b, len(b), 0) == b
        assert os.pread(fd_a, len(a), 0) == a
        for rel, data in files.items():  # old inodes (cached dentries) and new lookups
            with open(m.path(rel), "rb") as f:
                assert f.read() == data, rel
        for fd in (fd_a, fd_b):
            os.close(fd)
        fd_a = fd_b = -1
        assert second["mode"] == "passthrough"
        stats = m.stats()
        assert stats.get("resent_requests", 0) >= 1  # the kernel sent the dead daemon's read again
        assert stats["passthrough_opens"] >= 1  # b.bin still by passthrough (backing id taken over)
        assert m.proc.poll() is None  # the holder lives on
    finally:
        for fd in (fd_a, fd_b):
            if fd >= 0:
                os.close(fd)  # (after a failure: an open file would keep the unmounted file system alive)
        m.close()
    assert m.proc.returncode == 0


def test_interrupted_read_gets_eintr(s3, cache_dir, tmp_path, stopped_origin):
    _, client, bucket = s3
    put_tree(client, bucket, "ds", {"slow.bin": os.urandom(1 << 20)})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, f"s3://{bucket}/ds", str(mnt), env={"CACHEFS_ORIGIN_REQUEST_TIMEOUT": "60"})
    try:
        os.stat(m.path("slow.bin"))
        stopped_origin.stop()
        code = ("import os, signal, sys\n"
                "class Stop(Exception): pass\n"
                "def on_usr1(*_): raise Stop\n"
                "signal.signal(signal.SIGUSR1, on_usr1)\n"
                "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                "print('reading', flush=True)\n"
                "try:\n    os.read(fd, 65536)\nexcept Stop:\n    print('interrupted', flush=True)\n")
        reader = subprocess.Popen([sys.executable, "-c", code, m.path("slow.bin")], stdout=subprocess.PIPE, text=True)
        assert reader.stdout.readline().strip() == "reading"
        time.sleep(0.5)
        reader.send_signal(signal.SIGUSR1)
        out, _ = reader.communicate(timeout=20)  # the origin still hangs: only the interrupt can end the read
        assert out.strip() == "interrupted"
        assert m.stats().get("interrupted", 0) >= 1
    finally:
        stopped_origin.resume()
        m.close()


def test_stale_mount_is_cleaned_up_by_the_next_mount(mounted):
    m, files = mounted
    os.kill(m.proc.pid, signal.SIGKILL)  # holder first, so nobody restarts the daemon
    os.kill(m.wait_for_daemon()["pid"], signal.SIGKILL)
    m.proc.wait(10)
    deadline = time.monotonic() + 10
    while True:
        try:
            os.statvfs(m.mountpoint)
        except OSError as exc:
            assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    again = Mounted(m.cache_dir, m.url, m.mountpoint)
    try:
        with open(again.path("big/1.bin"), "rb") as f:
            assert f.read() == files["big/1.bin"]
    finally:
        again.close()


def test_unprivileged_mount_through_fusermount3_serves_in_userspace_mode():
    if shutil.which("fusermount3") is None or shutil.which("setpriv") is None:
        pytest.skip("needs fusermount3 (Debian fuse3; .ci/run installs it) and setpriv")
    import tempfile

    nobody = 65534
    base = tempfile.mkdtemp(prefix="cachefs-unpriv-", dir="/tmp")
    os.chmod(base, 0o755)
    src, cache, mnt = (os.path.join(base, d) for d in ("src", "cache", "mnt"))
    rng = random.Random(3)
    files = {f"d{i % 4}/f{i}.bin": rng.randbytes(rng.randint(0, 300_000)) for i in range(40)}
    for rel, data in files.items():
        os.makedirs(os.path.join(src, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(src, rel), "wb") as f:
            f.write(data)
    for d in (cache, mnt):
        os.mkdir(d)
        os.chown(d, nobody, nobody)
    # Not root and no CAP_SYS_ADMIN; CAP_DAC_READ_SEARCH only so that a Python installed under /root (pyenv)
    # can still be started.
    as_nobody = ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups",
                 "--inh-caps=-all,+dac_read_search", "--ambient-caps=-all,+dac_read_search"]
    env = {**os.environ, "HOME": base}
    cli = [sys.executable, "-m", "cachefs.cli.main"]
    # Distributions make /dev/fuse world-usable (udev: 0666); this VM leaves it 0600. Do as they do, then undo.
    dev_mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)
    holder = subprocess.Popen([*as_nobody, *cli, "mount", f"file://{src}", mnt, "--foreground", "--cache-dir", cache],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(r["mountpoint"] == mnt and r["pid"] for r in list_mounts(cache)):
            assert holder.poll() is None, holder.stdout.read()
            assert time.monotonic() < deadline, "unprivileged mount did not come up"
            time.sleep(0.1)
        check = ("import hashlib, os, sys, json\n"
                 "root = sys.argv[1]\n"
                 "out = {}\n"
                 "for d, _, names in os.walk(root):\n"
                 "    for n in names:\n"
                 "        p = os.path.join(d, n)\n"
                 "        out[os.path.relpath(p, root)] = hashlib.sha256(open(p, 'rb').read()).hexdigest()\n"
                 "print(json.dumps(out))\n")
        got = subprocess.run([*as_nobody, sys.executable, "-c", check, mnt], env=env, capture_output=True, text=True,
                             timeout=120, check=True).stdout
        assert json.loads(got) == {rel: sha(data) for rel, data in files.items()}
        status = subprocess.run([*as_nobody, *cli, "status", "--json", "--cache-dir", cache], env=env,
                                capture_output=True, text=True, timeout=60, check=True).stdout
        assert [m["mode"] for m in json.loads(status)["mounts"]] == ["userspace"]  # no CAP_SYS_ADMIN: no passthrough
        subprocess.run([*as_nobody, *cli, "umount", mnt], env=env, check=True, timeout=60)
        assert holder.wait(30) == 0
    finally:
        if holder.poll() is None:
            unmount(mnt)
            holder.kill()
        holder.stdout.close()
        os.chmod("/dev/fuse", dev_mode)
        shutil.rmtree(base, ignore_errors=True)


def test_a_file_says_how_much_of_it_is_cached_and_a_cache_aware_sampler_puts_that_first(mounted):
    """``user.cachefs.cached`` (getfattr) on a file of the mount: the bytes this node holds; what
    cachefs.torch.CacheAwareSampler asks to put cached samples first within each window."""
    from cachefs.torch import CacheAwareSampler, resident_under

    m, files = mounted
    with open(m.path("big/0.bin"), "rb") as f:
        assert f.read() == files["big/0.bin"]
    assert os.getxattr(m.path("big/0.bin"), "user.cachefs.cached") == str(len(files["big/0.bin"])).encode()
    assert int(os.getxattr(m.path("big/1.bin"), "user.cachefs.cached")) < len(files["big/1.bin"])
    assert os.listxattr(m.path("big/0.bin")) == ["user.cachefs.cached"] and os.listxattr(m.path("big")) == []
    with pytest.raises(OSError) as e:
        os.getxattr(m.path("big/0.bin"), "user.other")
    assert e.value.errno == errno.ENODATA
    paths = ["big/1.bin", "big/0.bin", "big/1.bin", "big/0.bin"]
    resident = resident_under(m.mountpoint)
    assert list(CacheAwareSampler(range(4), paths, resident=resident, window=2)) == [1, 0, 3, 2]
    assert list(CacheAwareSampler(range(4), paths, resident=resident, window=4)) == [1, 3, 0, 2]
    assert list(CacheAwareSampler(range(4), paths, resident=resident, window=1)) == [0, 1, 2, 3]


def test_an_order_published_through_the_mount_reaches_the_cache_and_only_from_its_callers_own_file(mounted, tmp_path):
    """A process that sees only the mount (a pod on a CSI volume) publishes its read order through it
    (cachefs.fuse.order_channel): the daemon takes the caller's own file and nothing else."""
    import cachefs
    from cachefs.base.errors import ConfigError
    from cachefs.base.types import DatasetRef
    from cachefs.index.orders import orders_dir

    m, files = mounted
    order = [m.path(p) for p in sorted(files, reverse=True)]  # paths under the mount, as a loader lists them
    answer = cachefs.publish_order(m.mountpoint, order, epoch=2, publisher="pod-a")
    assert answer == f"published {len(files)} files as pod-a"
    written = json.loads((Path(orders_dir(m.cache_dir, DatasetRef.from_url(m.url).id)) / "pod-a.json").read_text())
    assert written["paths"] == sorted(files, reverse=True) and written["epoch"] == 2
    with pytest.raises(ConfigError, match="refused the order"):  # a path that is not under the dataset
        cachefs.publish_order(m.mountpoint, ["/etc/passwd"], publisher="pod-a")
    theirs = tmp_path / "theirs.json"  # another user's file: the daemon must not read it for the caller ...
    theirs.write_text(json.dumps({"paths": ["big/0.bin"]}))
    os.chown(theirs, 65534, 65534)
    for name, err in ((f"user.cachefs.publish:{theirs}", errno.EACCES),
                      (f"user.cachefs.publish:{tmp_path}/missing.json", errno.ENOENT),
                      ("user.cachefs.publish:relative.json", errno.EINVAL)):
        with pytest.raises(OSError) as e:
            os.getxattr(m.mountpoint, name)
        assert e.value.errno == err, name
    with pytest.raises(OSError) as e:  # ... and only the root takes orders
        os.getxattr(m.path("big/0.bin"), f"user.cachefs.publish:{theirs}")
    assert e.value.errno == errno.ENODATA


def test_a_mount_whose_packed_mirror_cannot_be_used_says_so_in_status(s3, cache_dir, tmp_path):
    """A mirror that exists but cannot be used (here its index was replaced after packing) is named by `cachefs
    status` for the mount, not only in the mount's log (issue 37); the files are still read, one GET each."""
    _, client, bucket = s3
    files = make_files(n_small=30, big_sizes=())
    put_tree(client, bucket, "mds", files)
    url = f"s3://{bucket}/mds"
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "pack", url, "--cache-dir", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    client.put_object(Bucket=bucket, Key="mds.cachefs/index.arrow", Body=b"not the index it was")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, url, str(mnt))
    try:
        for rel, data in files.items():
            with open(m.path(rel), "rb") as f:
                assert f.read() == data
        deadline = time.monotonic() + 30
        while not (m.record() or {}).get("mirror_problem"):
            assert time.monotonic() < deadline, m.record()
            time.sleep(0.1)
        table = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--cache-dir", cache_dir],
                               capture_output=True, text=True, timeout=60).stdout
        assert "packed mirror cannot be used" in table, table
    finally:
        m.close()


def test_a_daemon_of_this_release_takes_the_inodes_a_previous_release_journalled(mounted, cache_dir):
    """Hand-over version 1 (a release before the inode table kept the kernel's inodes in the mount journal): the
    next daemon moves them into the table, and every inode the kernel holds goes on answering."""
    from cachefs.fuse.inode_table import InodeTable
    from cachefs.fuse.journal import replay
    from cachefs.index.mounts import mount_file

    m, files = mounted
    held = {rel: os.open(m.path(rel), os.O_RDONLY) for rel in list(files)[:20]}  # inodes the kernel holds open
    try:
        for d, _, names in os.walk(m.mountpoint):  # and the rest, looked up by a walk
            for name in names:
                os.stat(os.path.join(d, name))
        holder, daemon = m.proc.pid, m.wait_for_daemon()["pid"]
        os.kill(holder, signal.SIGSTOP)  # (so that it restarts the daemon only once the state is as a v1 left it)
        try:
            os.kill(daemon, signal.SIGKILL)
            while Path(f"/proc/{daemon}").exists() and "Z" not in Path(f"/proc/{daemon}/stat").read_text().split()[2]:
                time.sleep(0.02)
            table_path = mount_file(cache_dir, m.mountpoint, ".inodes")
            table = InodeTable(table_path, fresh=False)
            records = {}
            with table._env.begin() as txn:
                for key, _ in txn.cursor():
                    ino = int.from_bytes(key, "big")
                    records[ino] = table.get(ino)
            table.close()
            InodeTable.remove(table_path)
            assert len(records) > len(files)  # (the files and their directories)
            with open(mount_file(cache_dir, m.mountpoint, ".journal"), "a") as journal:
                for ino, r in records.items():
                    journal.write(json.dumps(["i", ino, r.path]) + "\n")
        finally:
            os.kill(holder, signal.SIGCONT)
        m.wait_for_daemon(other_than=daemon)
        for rel, fd in held.items():  # the kernel reads through the inodes it held, its page cache dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(fd, len(files[rel]) + 1, 0) == files[rel], rel
        for rel, data in files.items():
            with open(m.path(rel), "rb") as f:
                assert f.read() == data, rel
        assert replay(mount_file(cache_dir, m.mountpoint, ".journal")).inodes == {}  # (moved into the table)
    finally:
        for fd in held.values():
            os.close(fd)

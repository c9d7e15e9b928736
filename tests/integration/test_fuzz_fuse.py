"""The FUSE request decoder, fuzzed (Hypothesis): truncated and garbage requests, unknown opcodes, names with "/",
NUL or "..", huge offsets and sizes, headers whose lengths lie. Each gets an errno (or, for the requests the
kernel never answers, nothing) and the session keeps serving: a LOOKUP of a real file still works after each.

The session runs over a real engine and a file:// dataset; its replies go to a pipe instead of /dev/fuse."""

from __future__ import annotations

import errno
import fcntl
import os
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cachefs.base import aio
from cachefs.engine import Engine
from cachefs.fuse import kernel_abi as abi
from cachefs.fuse.fs import CacheFS
from cachefs.fuse.inode_table import InodeTable
from cachefs.fuse.kernel_abi import Op
from cachefs.fuse.session import FuseSession

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=20_000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

F_SETPIPE_SZ = 1031
NO_REPLY = {Op.FORGET, Op.BATCH_FORGET, Op.INTERRUPT}
#: Requests that legitimately change the session for good (DESTROY ends it, INIT starts it): not fuzzed here.
ENDS = {Op.DESTROY, Op.INIT}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from cachefs.base.config import load_config

    data = tmp_path_factory.mktemp("data")
    (data / "sub").mkdir()
    (data / "a.txt").write_bytes(b"hello" * 1000)
    (data / "sub" / "b.bin").write_bytes(os.urandom(200_000))
    config = load_config(env={}, overrides={"cache_dir": str(tmp_path_factory.mktemp("cache")),
                                            "cache_min_free": "0"})
    engine = Engine(config)
    ds = aio.run_sync(engine.open_dataset(f"file://{data}"))
    fs = CacheFS(engine, ds, inodes=InodeTable(str(tmp_path_factory.mktemp("mount") / "inodes")))
    r, w = os.pipe2(os.O_NONBLOCK)
    fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)
    sess = FuseSession(fs, w, passthrough=False)
    init = struct.pack("<IIII", 7, 31, 1 << 20, 0) + bytes(64)
    sess._handle(memoryview(request(Op.INIT, 1, 0, init)))
    drain(r)
    yield sess, r
    os.close(r)
    os.close(w)
    engine.close()


def request(opcode: int, unique: int, nodeid: int, body: bytes, length: int | None = None, extlen: int = 0) -> bytes:
    total = abi.IN_HEADER.size + len(body)
    return abi.IN_HEADER.pack(total if length is None else max(0, length), opcode, unique, nodeid, 0, 0, 1, extlen, 0) + body


def drain(fd: int, wait_for: int | None = None) -> list[tuple[int, int]]:
    """The replies written so far: (unique, -errno); with ``wait_for``, until that one came (a READ that missed
    is answered from the engine's thread), for up to 5 s."""
    import time

    deadline = time.monotonic() + 5
    replies = _read_replies(fd)
    while wait_for is not None and wait_for not in [u for u, _ in replies] and time.monotonic() < deadline:
        time.sleep(0.01)
        replies += _read_replies(fd)
    return replies


def _read_replies(fd: int) -> list[tuple[int, int]]:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    replies = []
    while len(out) >= abi.OUT_HEADER.size:
        length, err, unique = abi.OUT_HEADER.unpack_from(out)
        replies.append((unique, err))
        out = out[max(length, abi.OUT_HEADER.size):]
    return replies


def still_serving(sess, r) -> None:
    sess._handle(memoryview(request(Op.LOOKUP, 999_999, 1, b"a.txt\0")))
    assert (999_999, 0) in drain(r, 999_999), "a LOOKUP of a real file after the fuzzed request"


NAMES = st.one_of(st.binary(max_size=300), st.sampled_from([b"..\0", b".\0", b"a/b\0", b"a\0b\0", b"\0", b"sub/../a.txt\0",
                                                            b"x" * 300 + b"\0", b"a.txt"]))
BODIES = st.one_of(st.binary(max_size=120), NAMES,
                   st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)).map(
                       lambda t: struct.pack("<QQI", *t) + bytes(28)))


@given(opcode=st.one_of(st.sampled_from(sorted(set(Op) - ENDS)), st.integers(0, 2**32 - 1).filter(lambda o: o not in ENDS)),
       nodeid=st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(0, 2**64 - 1)), body=BODIES,
       length_delta=st.one_of(st.just(0), st.integers(-200, 200)), extlen=st.one_of(st.just(0), st.integers(0, 65535)))
@example(opcode=Op.FORGET, nodeid=1, body=b"", length_delta=0, extlen=0)
@example(opcode=Op.BATCH_FORGET, nodeid=0, body=struct.pack("<II", 1_000_000, 0), length_delta=0, extlen=0)
@example(opcode=Op.INTERRUPT, nodeid=0, body=b"\1", length_delta=0, extlen=0)
@example(opcode=Op.READ, nodeid=2, body=struct.pack("<QQIIIII", 1, 2**63, 2**31, 0, 0, 0, 0), length_delta=0, extlen=0)
@example(opcode=Op.LOOKUP, nodeid=1, body=b"../../etc/passwd\0", length_delta=0, extlen=0)
@example(opcode=Op.LOOKUP, nodeid=1, body=b"a.txt\0", length_delta=-30, extlen=0)
def test_any_request_gets_an_errno_and_the_session_keeps_serving(session, opcode, nodeid, body, length_delta,
                                                                  extlen):
    sess, r = session
    unique = 4242
    raw = request(opcode, unique, nodeid, body, abi.IN_HEADER.size + len(body) + length_delta, extlen)
    later = sess._handle(memoryview(raw))
    if later is not None:
        later.finish(sess)
    if opcode in NO_REPLY:
        assert not [u for u, _ in drain(r) if u == unique]
    else:
        replies = drain(r, unique)
        assert [u for u, _ in replies] == [unique], (opcode, replies)  # exactly one answer
        err = -replies[0][1]
        assert err == 0 or err in errno.errorcode, err
    still_serving(sess, r)

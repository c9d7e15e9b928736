"""Node pod generations (src/csi/generations.py): which sessions a new generation's mounter takes over from the
keepers beside its own, and which it leaves with the generation serving them. The hand-over itself, with real FUSE
sessions and a pod reading, is tests/e2e/test_csi.py; on a real node, tests/node/test_3_faults.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile

import pytest

from cachefs.fuse.keeper import HANDOVER_VERSION, SessionKeeper, keep_session, kept_sessions
from cachefs.index.mounts import left_behind
from csi.generations import predecessors, successor_present, takeable
from csi.mounter import LocalMounter


@pytest.fixture
def keepers():
    d = tempfile.mkdtemp(prefix="cfs-gen-")  # (a socket's path must stay short)
    started: list[SessionKeeper] = []

    def start(name: str) -> SessionKeeper:
        k = SessionKeeper(os.path.join(d, "keepers", f"{name}.sock"))
        k.start()
        started.append(k)
        return k

    yield d, start
    for k in started:
        k.stop()
    shutil.rmtree(d, ignore_errors=True)


def _deposit(keeper: SessionKeeper, mnt: str, meta: dict) -> None:
    r, w = os.pipe()  # any descriptor stands in for /dev/fuse here
    keep_session(keeper.path, mnt, w, meta, {})
    os.close(w)
    os.close(r)


def test_sessions_of_an_unknown_hand_over_version_stay_with_their_generation_and_status_says_why(keepers):
    d, start = keepers
    old = start("gen-old")
    root = os.path.join(d, "sessions")
    argv = ["cachefs", "mount", "s3://b/x", "/m", "--foreground"]
    _deposit(old, f"{root}/newer/mnt", {"argv": argv, "handover": HANDOVER_VERSION + 1, "release": "9.0.0"})
    _deposit(old, f"{root}/ancient/mnt", {"argv": argv})  # a release before the hand-over existed
    _deposit(old, "/elsewhere/mnt", {"argv": argv, "handover": HANDOVER_VERSION})  # not under this plugin's root
    own = os.path.join(d, "keepers", "gen-new.sock")
    assert successor_present(old.path) is False  # (the new generation's keeper is not up yet)
    mounter = LocalMounter(os.path.join(d, "cache"), keeper=own)
    cache = os.path.join(d, "cache")
    assert mounter.take_over(root)[0] == []
    left = left_behind(cache)
    assert set(left) == {f"{root}/newer/mnt", f"{root}/ancient/mnt"}
    assert f"version {HANDOVER_VERSION + 1}" in left[f"{root}/newer/mnt"] and "9.0.0" in left[f"{root}/newer/mnt"]
    assert "predates the hand-over" in left[f"{root}/ancient/mnt"]
    assert len(kept_sessions(old.path)) == 3  # nothing taken: the old generation keeps serving them
    assert mounter.holders == []


def test_only_answering_keepers_are_predecessors_and_a_dead_ones_socket_is_cleared(keepers):
    d, start = keepers
    old, new = start("gen-a"), start("gen-b")
    _deposit(old, "/s/a/mnt", {"argv": ["x"], "handover": HANDOVER_VERSION})
    dead = os.path.join(d, "keepers", "gen-dead.sock")
    with open(dead, "w"):  # a socket file whose process is gone refuses every connection
        pass
    assert stat.S_IMODE(os.stat(os.path.dirname(new.path)).st_mode) == 0o700  # every generation's keeper: root's
    assert stat.S_IMODE(os.stat(new.path).st_mode) == 0o600
    assert predecessors(new.path) == {old.path: {"/s/a/mnt": {"argv": ["x"], "handover": HANDOVER_VERSION}}}
    assert not os.path.exists(dead)
    assert successor_present(old.path) and successor_present(new.path)


def test_what_a_session_needs_to_be_taken_over():
    assert takeable({"argv": ["cachefs"], "handover": HANDOVER_VERSION}) == ""
    assert "no holder command" in takeable({"handover": HANDOVER_VERSION})
    assert takeable({"argv": ["cachefs"], "handover": "1"})  # not a number: not understood


def test_the_mounter_is_not_ready_while_an_earlier_pod_serves_a_session_it_could_not_take(keepers):
    """Its readiness gates the rolling update: while it is not ready the earlier pod stays, serving the session."""
    import threading
    import time

    from cachefs.fuse.keeper import drop_session
    from csi.mounter import serve_mounter

    d, start = keepers
    old = start("gen-old")
    root = os.path.join(d, "sessions")
    _deposit(old, f"{root}/k/mnt", {"argv": ["cachefs"], "handover": HANDOVER_VERSION + 1})
    ready_file, stop, up = os.path.join(d, "run", "ready"), threading.Event(), threading.Event()
    t = threading.Thread(target=serve_mounter, args=(os.path.join(d, "run", "m.sock"), root, os.path.join(d, "cache")),
                         kwargs={"keeper": os.path.join(d, "keepers", "gen-new.sock"), "ready_file": ready_file,
                                 "ready": up, "stop": stop}, daemon=True)
    t.start()
    try:
        assert up.wait(10)
        assert not os.path.exists(ready_file)
        drop_session(old.path, f"{root}/k/mnt")  # its pods ended: nothing is left with the earlier pod
        deadline = time.monotonic() + 20
        while not os.path.exists(ready_file):
            assert time.monotonic() < deadline, "the mounter never became ready"
            time.sleep(0.1)
        assert left_behind(os.path.join(d, "cache")) == {}
    finally:
        stop.set()
        t.join(10)


def test_the_sessions_pods_use_are_known_from_the_plugins_publish_record(tmp_path):
    """The next pod takes those over first (each waits only for its own hand-over; idle ones can wait)."""
    from csi.publishes import sessions_in_use
    from csi.volume import DatasetVolume

    vol = DatasetVolume.from_attributes({"url": "s3://b/imagenet"})
    (tmp_path / "publishes.json").write_text(json.dumps(
        {"/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/data/mount": {"attributes": {"url": "s3://b/imagenet"}}}))
    assert sessions_in_use(str(tmp_path)) == {vol.session_key}
    (tmp_path / "publishes.json").write_text("{not json")
    assert sessions_in_use(str(tmp_path)) == set()

"""The mount journal: what a restarted FUSE daemon replays."""

from __future__ import annotations

from cachefs.fuse import journal as journal_mod
from cachefs.fuse.journal import MountJournal, replay


def test_replay_gives_back_the_live_state(tmp_path):
    path = str(tmp_path / "m.journal")
    j = MountJournal.start(path)
    j.init("passthrough", 0x1234, 3)
    j.inode(10, "a/b")
    j.inode(11, "a/c")
    j.inode(10, "a/b")  # repeated: written once
    j.forget(11)
    j.backing(10, 7)
    j.backing(12, 8)
    j.backing_closed(12)
    assert not replay(path).opens_skipped
    j.skip_opens()
    j.close()
    s = replay(path)
    assert s.opens_skipped
    assert MountJournal.resume(path).state.opens_skipped  # (kept by the compaction too)
    assert replay(path).opens_skipped
    assert s.init == {"mode": "passthrough", "flags": 0x1234, "manifest_version": 3}
    assert s.inodes == {10: "a/b"}
    assert s.backing == {10: 7}
    assert _read(path).count('"a/b"') == 1


def test_a_forget_is_written_with_the_next_record_and_names_survive_escaping(tmp_path):
    """An inode is on disk before its lookup is answered; a forget waits for the next record (one write
    fewer per file), so a daemon killed in between leaves its successor an inode the kernel never names."""
    path = str(tmp_path / "m.journal")
    j = MountJournal.start(path)
    odd = 'd\u00e9j\u00e0 "quoted"\\back\udcff\n'
    j.inode(10, odd)
    j.inode(11, "b")
    j.forget(11)
    assert replay(path).inodes == {10: odd, 11: "b"}  # SIGKILL now: the forget is not written yet
    j.inode(12, "c")
    assert replay(path).inodes == {10: odd, 12: "c"}
    j.forget(12)
    j.close()  # a clean exit writes it
    assert replay(path).inodes == {10: odd}


def test_resume_counts_generations_and_compacts(tmp_path):
    path = str(tmp_path / "m.journal")
    j = MountJournal.start(path)
    for i in range(100):
        j.inode(i + 2, f"f{i}")
        j.forget(i + 2)
    j.init("userspace", 1, 0)
    j.close()
    size_before = len(_read(path))
    r = MountJournal.resume(path)
    assert r.state.generation == 1 and r.state.inodes == {} and r.state.init["mode"] == "userspace"
    assert len(_read(path)) < size_before / 10
    r.close()
    again = MountJournal.resume(path)
    assert again.state.generation == 2
    again.close()


def test_a_torn_last_line_is_ignored(tmp_path):
    path = str(tmp_path / "m.journal")
    j = MountJournal.start(path)
    j.inode(5, "x")
    j.close()
    with open(path, "a") as f:
        f.write('["i",6,"y')  # the writer died mid-write
    assert replay(path).inodes == {5: "x"}


def test_grows_no_further_than_the_compaction_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_mod, "COMPACT_BYTES", 4096)
    path = str(tmp_path / "m.journal")
    j = MountJournal.start(path)
    for i in range(2000):
        j.backing(9, i)
        j.backing_closed(9)
    j.close()
    assert len(_read(path)) <= 4096 + 100
    assert replay(path).backing == {}


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def test_compaction_is_amortised_when_the_live_state_is_large(tmp_path, monkeypatch):

    monkeypatch.setattr(journal_mod, "COMPACT_BYTES", 1000)
    j = journal_mod.MountJournal.start(str(tmp_path / "j"))
    rewrites = 0
    real = j._rewrite_locked

    def counting():
        nonlocal rewrites
        rewrites += 1
        real()

    monkeypatch.setattr(j, "_rewrite_locked", counting)
    for ino in range(2, 20_002):  # every inode stays live (a walk of a large tree): the state outgrows the limit
        j.inode(ino, f"d/f{ino}")
    j.close()
    assert rewrites <= 20  # doubling, not a rewrite per append
    assert len(journal_mod.replay(str(tmp_path / "j")).inodes) == 20_000


def test_versions_shown_from_a_provisional_tree_survive_replay_and_compaction_and_go_with_a_forget(tmp_path):
    path = str(tmp_path / "j")
    j = MountJournal.start(path)
    j.inode(10, "a/x.bin", "etag-1")  # handed out while the first listing ran
    j.inode(11, "a/y.bin")  # handed out from a manifest
    j.inode(12, "a/z.bin", "etag-3")
    j.forget(12)
    j.inode(13, "b")
    j.close()
    s = replay(path)
    assert s.versions == {10: "etag-1"} and s.inodes == {10: "a/x.bin", 11: "a/y.bin", 13: "b"}
    resumed = MountJournal.resume(path)  # (rewrites the file from the live state)
    resumed.close()
    assert replay(path).versions == {10: "etag-1"}

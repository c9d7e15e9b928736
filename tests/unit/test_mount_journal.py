"""The mount journal: what a restarted FUSE daemon replays."""

from __future__ import annotations

import json

from cachefs.fuse import journal as journal_mod
from cachefs.fuse.journal import MountJournal, replay


def test_replay_gives_back_the_live_state(tmp_path):
    path = str(tmp_path / "m.journal")
    j = MountJournal.start(path)
    j.init("passthrough", 0x1234, 3)
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
    assert s.backing == {10: 7} and s.inodes == {}


def _legacy(path, records: list) -> None:
    """A journal as a release before the inode table wrote it (hand-over version 1: inodes here)."""
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def test_a_previous_releases_inodes_are_read_with_their_versions_and_forgets_until_moved(tmp_path):
    path = str(tmp_path / "m.journal")
    odd = 'd\u00e9j\u00e0 "quoted"\\back\udcff\n'
    _legacy(path, [["gen", 0], ["init", {"mode": "userspace", "flags": 1, "manifest_version": 2}],
                   ["i", 10, odd], ["i", 11, "a/x.bin", "etag-1"], ["i", 12, "b"], ["f", 12]])
    s = replay(path)
    assert s.inodes == {10: odd, 11: "a/x.bin"} and s.versions == {11: "etag-1"}
    resumed = MountJournal.resume(path)  # (compacted: they stay until the table took them)
    assert replay(path).inodes == s.inodes and replay(path).versions == s.versions
    resumed.inodes_moved()
    resumed.close()
    again = replay(path)
    assert again.inodes == {} and again.versions == {} and again.init["manifest_version"] == 2


def test_resume_counts_generations_and_compacts(tmp_path):
    path = str(tmp_path / "m.journal")
    j = MountJournal.start(path)
    for i in range(100):
        j.backing(i + 2, i)
        j.backing_closed(i + 2)
    j.init("userspace", 1, 0)
    j.close()
    size_before = len(_read(path))
    r = MountJournal.resume(path)
    assert r.state.generation == 1 and r.state.backing == {} and r.state.init["mode"] == "userspace"
    assert len(_read(path)) < size_before / 10
    r.close()
    again = MountJournal.resume(path)
    assert again.state.generation == 2
    again.close()


def test_a_torn_last_line_is_ignored(tmp_path):
    path = str(tmp_path / "m.journal")
    j = MountJournal.start(path)
    j.backing(5, 1)
    j.close()
    with open(path, "a") as f:
        f.write('["b",6,2')  # the writer died mid-write
    assert replay(path).backing == {5: 1}


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
    for ino in range(2, 20_002):  # every backing file stays registered: the state outgrows the limit
        j.backing(ino, ino)
    j.close()
    assert rewrites <= 20  # doubling, not a rewrite per append
    assert len(journal_mod.replay(str(tmp_path / "j")).backing) == 20_000

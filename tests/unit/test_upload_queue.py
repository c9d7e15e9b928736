"""The upload queue's journal: what a writer was told is durable comes back after a crash, in order."""

from __future__ import annotations

import json

from cachefs.index.volumes import ENTRY_KINDS
from cachefs.write.queue import EntryKind, UploadQueue, under


def test_entries_come_back_in_order_after_a_crash_with_moves_drops_and_insertions(tmp_path):
    path = str(tmp_path / "journal")
    q = UploadQueue(path)
    a = q.add("put", "step.tmp/a", size=10, snap=q.reserve_seq())
    b = q.add("put", "step.tmp/b", size=20, snap=q.reserve_seq())
    log = q.add("put", "log.txt", size=5, snap=q.reserve_seq())
    q.move(a, "step/a")
    q.move(b, "step/b")
    q.add("claim", "step", before=a)
    q.add("commit", "step")
    q.drop(log)
    done = q.add("delete", "old")
    assert not q.start(done)  # (not the head: the uploader takes entries in order)
    q.finished(done)
    before = [(e.kind, e.key, e.size, e.snap) for e in q.entries]
    # (no close: the process died) and the last line was cut in half by the crash
    with open(path, "a") as f:
        f.write('{"t": "put", "seq": 99, "key": "half')
    again = UploadQueue(path)
    assert [(e.kind, e.key, e.size, e.snap) for e in again.entries] == before
    assert before == [("claim", "step", 0, 0), ("put", "step/a", 10, 1), ("put", "step/b", 20, 3),
                      ("commit", "step", 0, 0)]
    # the replay rewrote the journal with the live entries only
    with open(path) as f:
        assert len(f.readlines()) == 4
    assert again.next_seq > max(e.seq for e in again.entries)
    q.close()
    again.close()


def test_a_multipart_upload_begun_is_remembered_and_a_finished_queue_leaves_an_empty_journal(tmp_path):
    path = str(tmp_path / "journal")
    q = UploadQueue(path)
    e = q.add("put", "big.tmp", size=1 << 30, snap=q.reserve_seq())
    q.multipart_begins(e, "big.tmp")
    q.move(e, "big")  # (renamed while its parts went up: begun again under the new name)
    q.multipart_begins(e, "big")
    reread = UploadQueue(path)  # (replayed, then compacted: read twice)
    assert reread.entries[0].begun == ["big.tmp", "big"]
    reread.close()
    again = UploadQueue(path)
    assert again.entries[0].begun == ["big.tmp", "big"]
    again.close()
    assert q.start(e)
    q.finished(e)
    assert q.done_through(e.seq)
    with open(path) as f:
        assert f.read() == ""
    q.close()


def test_a_lost_commit_race_is_kept_as_failed(tmp_path):
    path = str(tmp_path / "journal")
    q = UploadQueue(path)
    e = q.add("claim", "ckpt")
    q.finished(e, failed="ckpt: committed by another writer first")
    again = UploadQueue(path)
    assert again.entries == [] and again.failed == {e.seq: "ckpt: committed by another writer first"}
    with open(path) as f:
        assert [json.loads(line)["t"] for line in f] == ["failed"]
    q.close()
    again.close()


def test_under():
    assert under("a/b", "a") and under("a", "a") and not under("ab", "a") and under("x", "")


def test_the_journal_reader_below_the_write_path_knows_every_entry_kind():
    assert {k.value for k in EntryKind} == ENTRY_KINDS


def test_an_entry_taken_as_the_head_starts_only_while_it_still_is_one(tmp_path):
    """The uploader reads the head, then starts it; a rename between the two (another thread) moves the entry to
    the end under the checkpoint's name and puts the checkpoint's claim before it. Started anyway, the object would
    reach the origin before its claim: a writer that then loses the claim leaves its object in the winner's
    checkpoint."""
    q = UploadQueue(str(tmp_path / "journal"))
    a = q.add("put", "step-9.tmp/a", size=10, snap=q.reserve_seq())
    b = q.add("put", "step-9.tmp/b", size=10, snap=q.reserve_seq())
    head = q.head(1)[0]
    assert head is a
    q.move(a, "step-9/a")  # the rename, meanwhile
    q.move(b, "step-9/b")
    claim = q.add("claim", "step-9", before=a)
    assert not q.start(head) and not head.running
    assert q.head(1)[0] is claim and q.start(claim) and claim.running
    q.finished(claim)
    assert q.start(q.head(1)[0]) and a.running and a.key == "step-9/a"
    q.close()

"""The mount's inode table: what the kernel holds, on disk, for this daemon and the next."""

from __future__ import annotations

from cachefs.fuse import inode_table
from cachefs.fuse.inode_table import InodeTable, path_ino


def test_lookups_are_counted_and_a_record_goes_when_the_kernel_forgets_the_last(tmp_path):
    t = InodeTable(str(tmp_path / "m.inodes"))
    (a, ra), (b, _) = t.looked_up([("d/a", ""), ("d/b", "")])
    assert a == path_ino("d/a") and ra.lookups == 1 and ra.path == "d/a"
    assert t.looked_up([("d/a", "")])[0] == (a, ra._replace(lookups=2))
    assert t.forget([(a, 1), (b, 1)]) == [b]
    assert t.get(a).lookups == 1 and t.get(b) is None
    assert t.forget([(a, 5)]) == [a]  # (more than it held: gone, not negative)
    assert len(t) == 0 and t.forget([(a, 1)]) == []


def test_a_restarted_daemon_finds_the_records_a_new_mount_does_not(tmp_path):
    path = str(tmp_path / "m.inodes")
    t = InodeTable(path, generation=0)
    (ino, _), = t.looked_up([("x/y.bin", "etag-1")])
    t.opened(ino)
    t.close()
    again = InodeTable(path, generation=1, fresh=False)
    r = again.get(ino)
    assert r is not None and (r.path, r.lookups, r.generation, r.opened, r.version) == ("x/y.bin", 1, 0, True, "etag-1")
    # looked up again: the count grows, the version the kernel was shown first stays
    assert again.looked_up([("x/y.bin", "etag-2")])[0][1].version == "etag-1"
    again.close()
    assert InodeTable(path, generation=0, fresh=True).get(ino) is None


def test_paths_whose_numbers_collide_each_get_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(inode_table, "path_ino", lambda path: 100)
    t = InodeTable(str(tmp_path / "m.inodes"))
    got = t.looked_up([("a", ""), ("b", ""), ("a", "")])  # (a collision within one transaction too)
    assert [ino for ino, _ in got] == [100, 101, 100]
    assert t.get(101) == got[1][1] and t.get(102) is None
    assert t.forget([(100, 2)]) == [100] and t.get(100) is None
    assert t.looked_up([("b", "")])[0][0] == 101  # (a freed number before it does not move what came after)
    assert t.looked_up([("a", "")])[0][0] == 100 and t.get(100).lookups == 1  # (its number again)
    assert t.forget([(101, 2)]) == [101] and t.get(101) is None


def test_a_previous_releases_journalled_inodes_are_taken_as_handed_out_before(tmp_path):
    t = InodeTable(str(tmp_path / "m.inodes"), generation=3, fresh=False)
    t.adopt({10: "a/b", 11: "a/c"}, {11: "etag"})
    assert t.get(10) == inode_table.InodeRecord("a/b", 1, 2, True, "")
    assert t.get(11).version == "etag" and len(t) == 2


def test_with_no_room_on_disk_it_goes_on_in_memory(tmp_path):
    t = InodeTable(str(tmp_path / "m.inodes"))
    (kept, _), = t.looked_up([("on-disk", "")])
    t._env.set_mapsize(64 << 10)  # a map this small fills at once, as a full disk refuses the next page
    got = t.looked_up([(f"f{i}", "") for i in range(2000)])
    assert t.degraded
    assert all(t.get(ino) == r for ino, r in got) and t.get(kept).path == "on-disk"
    assert len(t) == 2001
    assert t.forget([(kept, 1)]) == [kept] and t.get(kept) is None and len(t) == 2000

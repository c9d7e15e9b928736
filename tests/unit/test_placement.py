"""Weighted rendezvous placement over a slot table: owners agree with a full rebuild after incremental changes,
a join or leave moves about 1/N of the keys, and weights set the shares."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cachefs.cluster.placement import RANK, SLOTS, Placement, Weighted


def group(n: int, weight=lambda i: 1.0) -> list[Weighted]:
    return [Weighted(f"node-{i:04d}", weight(i)) for i in range(n)]


def test_owners_are_distinct_best_first_and_stable():
    p = Placement(group(20))
    keys = [os.urandom(24) for _ in range(1000)]
    for k in keys:
        owners = p.owners(k)
        assert len(owners) == RANK == len(set(owners))
        assert owners[0] == p.owner(k)
    again = Placement(group(20))
    assert all(p.owners(k) == again.owners(k) for k in keys)  # the same members, the same answer everywhere


@pytest.mark.parametrize("n", [10, 50])
def test_a_join_or_a_leave_moves_about_one_nth_of_the_keys(n):
    base = Placement(group(n))
    joined = base.joined(Weighted("node-new"))
    moved = np.count_nonzero(base.slot_owners() != joined.slot_owners()) / SLOTS
    assert abs(moved - 1 / (n + 1)) < 0.1 / (n + 1) + 0.002, moved
    left = base.left("node-0003")
    # remaining names shift index by one after the removed one; compare by name
    before = [base.names[i] for i in base.slot_owners()]
    after = [left.names[i] for i in left.slot_owners()]
    moved = sum(a != b for a, b in zip(before, after, strict=True)) / SLOTS
    assert abs(moved - 1 / n) < 0.1 / n + 0.002, moved
    # only the leaver's slots moved, and each to someone else
    assert all(b == "node-0003" for a, b in zip(after, before, strict=True) if a != b)


def test_incremental_changes_equal_a_full_rebuild():
    p = Placement(group(30)).joined(Weighted("x", 2.0)).left("node-0007").joined(Weighted("y", 0.5))
    full = Placement([*[m for m in group(30) if m.name != "node-0007"], Weighted("x", 2.0), Weighted("y", 0.5)])
    assert [p.names[i] for i in p.slot_owners()] == [full.names[i] for i in full.slot_owners()]
    keys = [os.urandom(16) for _ in range(500)]
    assert all(p.owners(k) == full.owners(k) for k in keys)


def test_weights_set_the_shares():
    p = Placement(group(40, lambda i: 3.0 if i < 4 else 1.0))
    heavy = np.mean([p.owned_share(f"node-{i:04d}") for i in range(4)])
    light = np.mean([p.owned_share(f"node-{i:04d}") for i in range(4, 40)])
    assert 2.5 < heavy / light < 3.5, heavy / light


def test_small_groups_and_empty_ones():
    assert Placement([]).owner(b"k") is None and Placement([]).owners(b"k") == []
    one = Placement([Weighted("solo")])
    assert one.owners(b"k") == ["solo"]
    two = one.joined(Weighted("duo"))
    assert sorted(two.owners(b"k")) == ["duo", "solo"]
    assert two.left("solo").owners(b"k") == ["duo"] and two.left("duo").left("solo").owners(b"k") == []


def test_small_files_are_placed_by_windows_of_their_directory():
    """Neighbours in a directory share an owner; a directory larger than a window spreads over the members."""
    import bisect
    from types import SimpleNamespace

    from cachefs.cluster.keys import SMALL_WINDOW, DirectoryWindows

    names = [f"img_{i:06d}.jpg" for i in range(SMALL_WINDOW * 40)]

    def listdir_page(parent, after, limit):  # (the manifest's: name order, from after a name)
        first = 0 if after is None else bisect.bisect_right(names, after)
        return [SimpleNamespace(name=n) for n in names[first:first + limit]]

    ds = SimpleNamespace(ref=SimpleNamespace(id="d" * 16), version=3, listdir_page=listdir_page)
    windows = DirectoryWindows()
    keys = [windows.key(ds, f"train/{n}") for n in names]
    assert keys[0] == keys[SMALL_WINDOW - 1] != keys[SMALL_WINDOW]
    assert len(set(keys)) == 40
    placement = Placement([Weighted(f"n{i}") for i in range(4)])
    owners = {placement.owner(k) for k in set(keys)}
    assert len(owners) == 4  # the one directory is served by every member


def test_the_agents_table_is_handed_to_readers_only_for_the_same_members(tmp_path):
    """The agent writes its table; a reader whose members file names the same members and weights loads it
    instead of building it (seconds at thousands of members); anything else, or a damaged file, is not used."""
    import numpy as np

    from cachefs.cluster.membership import MemberTable, parse_peers

    members = [Weighted(f"n{i}", 1.0 + (i % 3)) for i in range(300)]
    made = Placement(members)
    path = str(tmp_path / "placement.npz")
    made.save(path)
    loaded = Placement.load(path, list(reversed(members)))  # (order does not matter, names and weights do)
    assert loaded is not None
    assert (np.array(loaded.names)[loaded.slot_owners()] == np.array(made.names)[made.slot_owners()]).all()
    assert Placement.load(path, members[:-1]) is None
    assert Placement.load(path, [*members[:-1], Weighted("n299", 9.0)]) is None
    assert Placement.load(str(tmp_path / "none.npz"), members) is None
    (tmp_path / "bad.npz").write_bytes(b"not a table")
    assert Placement.load(str(tmp_path / "bad.npz"), members) is None
    # A reader's first view takes it.
    table = MemberTable("")
    spec = ",".join(f"{m.name}=10.0.0.{i % 250}:1@{m.weight}" for i, m in enumerate(members))
    handed = Placement.load(path, members)
    table.replace(parse_peers(spec), frozenset(), made=lambda ms: handed if Placement.load(path, ms) else None)
    assert table.placement is handed
    assert (np.array(table.placement.names)[table.placement.slot_owners()]
            == np.array(made.names)[made.slot_owners()]).all()

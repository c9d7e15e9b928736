"""The read-only file system's inodes: what the kernel holds is on disk, and memory holds a bounded set of nodes."""

from __future__ import annotations

import errno

import pytest

from cachefs.base import aio
from cachefs.engine import Engine
from cachefs.fuse import fs as fs_mod
from cachefs.fuse.fs import ROOT, CacheFS
from cachefs.fuse.inode_table import InodeTable


@pytest.fixture
def tree(tmp_path):
    from cachefs.base.config import load_config

    data = tmp_path / "data"
    for d in range(4):
        (data / f"d{d}").mkdir(parents=True)
        for f in range(250):
            (data / f"d{d}" / f"f{f:03d}").write_bytes(b"%d/%d" % (d, f))
    config = load_config(env={}, overrides={"cache_dir": str(tmp_path / "cache"), "cache_min_free": "0"})
    engine = Engine(config)
    ds = aio.run_sync(engine.open_dataset(f"file://{data}"))
    yield engine, ds, str(tmp_path / "m.inodes")
    engine.close()


def _walk(fs: CacheFS) -> dict[str, int]:
    """What a `find` does through READDIRPLUS: every entry handed to the kernel once."""
    inos = {}
    for d in fs.listdir_page(ROOT, None, 1 << 30):
        ((dino, _),) = fs.adopt([d])
        children = fs.listdir_page(dino, None, 1 << 30)
        for child, (ino, shown) in zip(children, fs.adopt(children), strict=True):
            assert shown == child
            inos[child.path] = ino
    return inos


def test_a_walk_keeps_a_bounded_set_of_nodes_and_every_inode_answers(tree, monkeypatch):
    engine, ds, path = tree
    monkeypatch.setattr(fs_mod, "NODE_CACHE", 64)
    fs = CacheFS(engine, ds, inodes=InodeTable(path))
    inos = _walk(fs)
    assert len(inos) == 1000 and len(fs.inodes) == 1004  # (and the four directories)
    assert len(fs._nodes) <= 64 + 1  # (a walk makes no node: READDIRPLUS answers from the entries it lists)
    for p, ino in inos.items():  # made now, and let go of past the limit: each answers with its own entry
        assert fs.node(ino).entry.path == p
        d, f = p.split("/")
        assert fs.attr(ino)[1] == len(f"{int(d[1:])}/{int(f[1:])}")
    assert len(fs._nodes) <= 64 + 1


def test_the_kernel_forgetting_an_inode_ends_it_and_an_open_one_goes_at_its_release(tree):
    engine, ds, path = tree
    fs = CacheFS(engine, ds, inodes=InodeTable(path))
    inos = _walk(fs)
    a, b = inos["d0/f001"], inos["d0/f002"]
    fh, _ = fs.open(b, 0)
    fs.forget([(a, 1), (b, 1)])
    with pytest.raises(OSError) as err:
        fs.node(a)
    assert err.value.errno == errno.ESTALE
    assert fs.node(b).opens == 1  # open: still served
    fs.release(b, fh)
    assert b not in fs._nodes and fs.inodes.get(b) is None


def test_a_restarted_daemon_knows_what_the_kernel_held_and_which_were_opened(tree):
    engine, ds, path = tree
    first = CacheFS(engine, ds, inodes=InodeTable(path, generation=0))
    inos = _walk(first)
    opened, untouched = inos["d1/f010"], inos["d1/f011"]
    first.release(opened, first.open(opened, 0)[0])
    assert first.node(untouched).unopened and not first.node(opened).unopened
    first.inodes.close()
    second = CacheFS(engine, ds, inodes=InodeTable(path, generation=1, fresh=False))
    # handed out by the previous daemon: its pages may be cached, so nothing counts as never opened
    assert not second.node(untouched).unopened and not second.node(opened).unopened
    assert second.node(inos["d3/f249"]).entry.path == "d3/f249"
    ((again, _),) = second.adopt([second.node(untouched).entry])
    assert again == untouched and second.inodes.get(untouched).lookups == 2

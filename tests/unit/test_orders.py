"""Declared read orders (cachefs.prefetch.orders, cachefs.prefetch.publish, ``cachefs order``): what a reader
opens next is handed out once, within the byte budget, per publisher; bad orders get clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cachefs
from cachefs.base.errors import ConfigError
from cachefs.base.types import DatasetRef
from cachefs.index.orders import orders_dir, write_order
from cachefs.prefetch.orders import OrderBook

URL = "s3://bucket/ds"
DS = DatasetRef.from_url(URL).id


def _sizes(path: str) -> int:
    return 10


def _opened(book: OrderBook, *args) -> list[str]:
    return [path for path, _ in book.opened(*args)]


def test_a_reader_gets_what_comes_next_in_its_order_once_within_the_budget(tmp_path):
    order = [f"f{i}" for i in range(100)]
    write_order(str(tmp_path), DS, URL, order, epoch=3, publisher="job-a")
    book = OrderBook(str(tmp_path))
    assert _opened(book, DS, "f0", 50, _sizes) == ["f1", "f2", "f3", "f4", "f5"]
    assert _opened(book, DS, "f1", 50, _sizes) == ["f6"]  # one more fits as the reader moves on
    assert _opened(book, DS, "f1", 50, _sizes) == []  # nothing is handed out twice
    assert book.ahead()[:2] == (5, 50)  # f2-f6 on their way (what cachefs_order_ahead_* show)
    assert _opened(book, DS, "f60", 50, _sizes) == []  # a stray open (another job's reader): nothing moves
    assert _opened(book, DS, "f2", 50, _sizes) == ["f7"]  # its own reader moves on
    assert _opened(book, DS, "f40", 50, _sizes) == []  # a jump ...
    assert _opened(book, DS, "f41", 50, _sizes) == [f"f{i}" for i in range(42, 47)]  # ... that the next open confirms
    assert _opened(book, DS, "not-in-it", 50, _sizes) == []
    (info,) = book.orders(DS)
    assert info["publisher"] == "job-a" and info["epoch"] == 3 and info["files"] == 100 and info["reached"] == 42


def test_what_the_reader_passed_meanwhile_is_no_longer_ahead(tmp_path):
    write_order(str(tmp_path), DS, URL, [f"f{i}" for i in range(100)], epoch=None, publisher="p")
    book = OrderBook(str(tmp_path))
    handed = dict(book.opened(DS, "f0", 30, _sizes))
    assert all(check() for check in handed.values())
    book.opened(DS, "f2", 30, _sizes)  # the reader read f1 and f2 itself before their fetches started
    assert [p for p, check in handed.items() if check()] == ["f3"]


def test_a_file_is_passed_once_every_order_holding_it_has_its_reader_past_it(tmp_path):
    """What eviction by next use may take first (cachefs.node.eviction): files no order will read again."""
    write_order(str(tmp_path), DS, URL, [f"f{i}" for i in range(50)], epoch=0, publisher="job-a")
    book = OrderBook(str(tmp_path))
    assert not book.passed(DS, "f0")  # no reader yet
    for i in range(6):
        book.opened(DS, f"f{i}", 30, _sizes)
    assert [f"f{i}" for i in range(50) if book.passed(DS, f"f{i}")] == ["f0", "f1", "f2", "f3", "f4"]  # f5: open now
    assert not book.passed(DS, "not-in-it") and not book.passed("other-dataset", "f0")
    write_order(str(tmp_path), DS, URL, [f"f{i}" for i in reversed(range(50))], epoch=0, publisher="job-b")
    book.reread(DS)  # (else read again within a second)
    book.opened(DS, "f49", 30, _sizes)  # job b's reader starts at the other end
    assert not book.passed(DS, "f0")  # job b still has f0 ahead
    for i in reversed(range(1, 49)):
        book.opened(DS, f"f{i}", 30, _sizes)
    book.opened(DS, "f6", 30, _sizes)  # (job a's reader, near where it was)
    assert book.passed(DS, "f3") and not book.passed(DS, "f0")  # job b is at f1 now
    book.opened(DS, "f7", 30, _sizes)
    for i in range(8, 50):  # job a's reader finishes its epoch: its next order will read everything again
        book.opened(DS, f"f{i}", 30, _sizes)
    assert not book.passed(DS, "f3")


def test_an_order_published_in_this_process_is_followed_at_once(tmp_path):
    """(Orders are read again once a second; one this process wrote is read at the next look.)"""
    book = OrderBook(str(tmp_path))
    cachefs.publish_order(URL, ["a", "b", "c"], epoch=0, cache_dir=str(tmp_path), publisher="p")
    assert _opened(book, DS, "a", 100, _sizes) == ["b", "c"]
    cachefs.publish_order(URL, ["c", "b", "a"], epoch=1, cache_dir=str(tmp_path), publisher="p")
    assert _opened(book, DS, "c", 100, _sizes) == ["b", "a"]


def test_files_already_here_take_no_budget(tmp_path):
    write_order(str(tmp_path), DS, URL, [f"f{i}" for i in range(10)], epoch=None, publisher="p")
    book = OrderBook(str(tmp_path))
    here = {"f1", "f2"}
    assert _opened(book, DS, "f0", 30, lambda p: None if p in here else 10) == ["f3", "f4", "f5"]


def test_two_jobs_on_one_dataset_each_keep_their_order_and_budget(tmp_path):
    write_order(str(tmp_path), DS, URL, [f"f{i}" for i in range(50)], epoch=0, publisher="job-a")
    write_order(str(tmp_path), DS, URL, [f"f{i}" for i in reversed(range(50))], epoch=0, publisher="job-b")
    book = OrderBook(str(tmp_path))
    got_a = _opened(book, DS, "f0", 30, _sizes)  # job a's reader
    assert got_a[:3] == ["f1", "f2", "f3"]
    got_b = _opened(book, DS, "f49", 30, _sizes)  # job b's reader, at the other end
    assert got_b == ["f48", "f47", "f46"]
    assert {o["publisher"] for o in book.orders(DS)} == {"job-a", "job-b"}


def test_a_new_order_of_the_same_publisher_replaces_its_last(tmp_path):
    write_order(str(tmp_path), DS, URL, ["a", "b", "c"], epoch=0, publisher="p")
    book = OrderBook(str(tmp_path))
    assert _opened(book, DS, "a", 100, _sizes) == ["b", "c"]
    path = write_order(str(tmp_path), DS, URL, ["c", "b", "a"], epoch=1, publisher="p")
    later = os.stat(path).st_mtime + 5
    os.utime(path, (later, later))  # (a different stamp, as a later write has)
    book._read_at.clear()
    assert _opened(book, DS, "c", 100, _sizes) == ["b", "a"]
    assert [o["epoch"] for o in book.orders(DS)] == [1]


@pytest.mark.parametrize(("paths", "words"), [
    (["/abs/path"], "not under the dataset"),
    (["s3://other/x"], "not under the dataset"),
    (["a/../b"], "relative to the dataset"),
    ([7], "not a string"),
])
def test_bad_orders_are_clear_errors(tmp_path, paths, words):
    with pytest.raises(ConfigError, match=words):
        cachefs.publish_order(URL, paths, cache_dir=str(tmp_path))


def test_publish_order_takes_urls_and_relative_paths_and_a_mount_point_must_be_a_mount(tmp_path):
    written = cachefs.publish_order(URL, [f"{URL}/x/1.jpg", "x/2.jpg"], epoch=2, cache_dir=str(tmp_path),
                                    publisher="rank-0")
    assert written == os.path.join(orders_dir(str(tmp_path), DS), "rank-0.json")
    doc = json.loads(Path(written).read_text())
    assert doc["paths"] == ["x/1.jpg", "x/2.jpg"] and doc["epoch"] == 2 and doc["dataset"] == URL
    with pytest.raises(ConfigError, match="not a cachefs mount"):  # (a directory, not a mount of ours)
        cachefs.publish_order(str(tmp_path), ["x"], cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="nor a directory"):
        cachefs.publish_order(str(tmp_path / "nothing"), ["x"])
    with pytest.raises(ConfigError, match="publisher name"):
        cachefs.publish_order(URL, ["x"], cache_dir=str(tmp_path), publisher="a/b")


def test_the_order_command_reads_a_file_or_stdin(tmp_path):
    cache = str(tmp_path / "cache")
    run = [sys.executable, "-m", "cachefs.cli.main", "order", URL, "--cache-dir", cache, "--publisher", "cli"]
    r = subprocess.run([*run, "--file", "-", "--epoch", "4"], input="b\na\n\n", capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "published an order of 2 files" in r.stdout, r.stderr
    assert json.loads(Path(orders_dir(cache, DS), "cli.json").read_text())["paths"] == ["b", "a"]
    bad = subprocess.run([*run, "--file", str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "missing" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "bin").write_bytes(b"\xff\xfe\n")
    bad = subprocess.run([*run, "--file", str(tmp_path / "bin")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "UTF-8" in bad.stderr and "Traceback" not in bad.stderr


class _Shuffled:
    """DistributedSampler's contract as far as it matters here: a new permutation per epoch, set_epoch, len."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import random

        order = list(range(self.n))
        random.Random(self.epoch).shuffle(order)
        return iter(order)


def test_a_publishing_sampler_publishes_each_epochs_order_and_yields_it_unchanged(tmp_path):
    from cachefs.torch import PublishingSampler

    paths = [f"img/{i}.jpg" for i in range(20)]
    sampler = PublishingSampler(_Shuffled(20), paths, dataset=URL, cache_dir=str(tmp_path), publisher="rank-3")
    assert len(sampler) == 20
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        got = list(sampler)
        plain = _Shuffled(20)
        plain.set_epoch(epoch)
        assert got == list(plain)  # the order the model sees is the wrapped sampler's
        doc = json.loads(Path(orders_dir(str(tmp_path), DS), "rank-3.json").read_text())
        assert doc["paths"] == [paths[i] for i in got] and doc["epoch"] == epoch

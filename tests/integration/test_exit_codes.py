"""README's exit-code table against what the commands do: one case per command and mistake, each exiting with the
code README gives for its kind of failure, with one line saying what is wrong (a real S3 server on loopback)."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.conftest import put_tree
from tests.integration.test_cli_newcomer import _one_line
from tests.integration.test_fsspec_cli import cli

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def readme_codes() -> dict[str, int]:
    """README's "Exit codes:" sentence as {meaning: code}: ``0 ok, 1 other failure, 2 bad input (...)`` ..."""
    with open(README) as f:
        text = " ".join(f.read().split())
    sentence = text[text.index("Exit codes:"):].split(". ", 1)[0]
    return {m.group(2).strip(): int(m.group(1)) for m in re.finditer(r"(\d+) ([a-z ]+?)(?: \(|,|$)", sentence)}


def test_readme_names_every_code_the_cli_uses():
    from cachefs.cli.main import EXIT_CODES

    codes = readme_codes()
    assert {"ok", "other failure", "bad input", "credentials", "origin unreachable", "cache disk full", "not found",
            "interrupted"} <= set(codes), codes
    assert {c for _cls, c in EXIT_CODES} <= set(codes.values())


@pytest.fixture
def small(s3):
    _, client, bucket = s3
    put_tree(client, bucket, "data", {"a.bin": os.urandom(1000), "b/c.bin": os.urandom(2000)})
    return bucket


# (argv, README's kind of failure, what the line must say)
CASES = [
    (["checkpoints", "s3://no-such-bucket-cfs/x"], "not found", "bucket"),
    (["prefetch", "s3://no-such-bucket-cfs/data"], "not found", "bucket no-such-bucket-cfs not found: it does not exist"),
    (["evict", "s3://{bucket}/never-seen"], "not found", "not in this cache"),
    (["prefetch", "s3://{bucket}/data", "--include", "nomatch/*"], "not found", "nothing matched"),
    (["prefetch", "s3://{bucket}/nope"], "not found", "no objects under this prefix"),
    (["order", "s3://{bucket}/data", "--file", "{paths}", "--epoch", "-3"], "bad input", "--epoch"),
    (["prefetch", "s3://{bucket}/data", "--capacity", "999999999TB"], "bad input", "cache.capacity"),
    (["sync", "--timeout", "-5"], "bad input", "--timeout"),
    (["prefetch", "s3:/data"], "bad input", "not a URL"),
    (["prefetch", "http://127.0.0.1:1/y"], "origin unreachable", "cannot reach the origin"),
]


@pytest.mark.parametrize("argv, kind, says", CASES, ids=[" ".join(c[0][:2]) + f" [{c[2]}]" for c in CASES])
def test_each_mistake_exits_as_readme_says(small, tmp_path, argv, kind, says):
    paths = tmp_path / "order.txt"
    paths.write_text("a.bin\nb/c.bin\n")
    argv = [a.replace("{bucket}", small).replace("{paths}", str(paths)) for a in argv]
    if argv[0] == "evict":  # (a cache that exists, holding another dataset)
        assert cli("prefetch", f"s3://{small}/data", "--cache-dir", str(tmp_path / "cache")).returncode == 0
    r = cli(*argv, "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == readme_codes()[kind], (r.returncode, r.stderr)
    assert says in _one_line(r)


def test_messages_name_what_is_wrong(small, tmp_path):
    cache = str(tmp_path / "cache")
    r = cli("order", f"s3://{small}/data", "--sampler", "torch-distributed:seed=abc", "--cache-dir", cache)
    assert r.returncode == 2 and "seed must be a whole number, not 'abc'" in _one_line(r)
    assert cli("prefetch", f"s3://{small}/data", "--cache-dir", cache).returncode == 0
    paths = tmp_path / "order.txt"
    paths.write_text("a.bin\nnot/there.bin\nb/c.bin\nnor/this\n")
    r = cli("order", f"s3://{small}/data", "--file", str(paths), "--cache-dir", cache)
    assert r.returncode == 0, r.stderr
    assert "published an order of 4 files" in r.stdout and "2 of them are not files of the dataset's manifest v1" \
        in r.stdout and "first: not/there.bin" in r.stdout, r.stdout
    # (a capacity of the whole disk: the disk's free space, not the capacity, bounds what the cache can use)
    r = cli("status", "--cache-dir", cache, env={"CACHEFS_CACHE_CAPACITY": "100%", "CACHEFS_CACHE_MIN_FREE": "0"})
    assert r.returncode == 0 and "usable (capacity" in r.stdout and "the disk runs out first" in r.stdout, r.stdout


def test_status_without_cache_dir_shows_the_cache_just_used_or_names_the_others(small, tmp_path):
    from cachefs.base.config import default_cache_dir
    from cachefs.index.caches import is_cache

    state = {"XDG_STATE_HOME": str(tmp_path / "state")}  # (only the caches this test makes are known)
    used = str(tmp_path / "used")
    assert cli("prefetch", f"s3://{small}/data", "--cache-dir", used, env=state).returncode == 0
    r = cli("status", env=state)
    assert r.returncode == 0, r.stderr
    if is_cache(default_cache_dir()):  # (the default holds a cache too: it is shown, and the other one named)
        assert f"other caches on this node: {used}" in r.stdout, r.stdout
    else:
        assert f"cache dir  {used}" in r.stdout and f"s3://{small}/data" in r.stdout, r.stdout
    r = cli("refresh", f"s3://{small}/data", env=state)  # (in the cache that holds it: its second manifest)
    assert r.returncode == 0 and "manifest v2" in r.stdout, r.stdout + r.stderr
    r = cli("prefetch", f"s3://{small}/data", env=state)  # (the same cache again: nothing left to fetch)
    assert r.returncode == 0 and "(0 B fetched" in r.stdout, r.stdout + r.stderr
    second = str(tmp_path / "second")
    assert cli("prefetch", f"s3://{small}/data", "--cache-dir", second, env=state).returncode == 0
    r = cli("status", f"s3://{small}/data", env=state)  # (in two caches now: which one is meant?)
    assert r.returncode == 2 and "in 2 caches on this node" in _one_line(r) and used in r.stderr and second in r.stderr


def test_status_after_a_refresh_counts_only_the_current_manifests_bytes(s3, tmp_path):
    """A changed object's old version stays cached for readers of the old manifest; status shows it apart (issue 48,
    item 6: CACHED was above 100 %, cached_bytes above total_bytes)."""
    _, client, bucket = s3
    put_tree(client, bucket, "ds", {"a.bin": os.urandom(300_000), "small.txt": os.urandom(3_000),
                                    "b.bin": os.urandom(200_000)})
    cache = str(tmp_path / "cache")
    assert cli("prefetch", f"s3://{bucket}/ds", "--cache-dir", cache).returncode == 0
    put_tree(client, bucket, "ds", {"a.bin": os.urandom(250_000), "small.txt": os.urandom(2_000)})  # both changed
    assert cli("refresh", f"s3://{bucket}/ds", "--cache-dir", cache).returncode == 0
    assert cli("prefetch", f"s3://{bucket}/ds", "--cache-dir", cache).returncode == 0
    r = cli("status", "--json", "--cache-dir", cache)
    [ds] = json.loads(r.stdout)["datasets"]
    assert ds["total_bytes"] == 250_000 + 2_000 + 200_000
    assert ds["cached_bytes"] == ds["total_bytes"] and ds["cached_fraction"] == 1.0, ds
    assert ds["old_version_bytes"] == 300_000 + 3_000, ds
    text = cli("status", "--cache-dir", cache).stdout
    assert "100.0%" in text and "of earlier manifests" in text, text

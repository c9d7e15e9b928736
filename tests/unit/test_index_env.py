"""The process-wide registry of LMDB environments gives back the ones whose cache directory was removed."""

from __future__ import annotations

import shutil

from cachefs.index import env as index_env


def _put(path: str, value: bytes) -> None:
    env, dbs = index_env.open_env(path)
    with env.begin(write=True) as txn:
        txn.put(b"k", value, db=dbs["meta"])


def _get(path: str) -> bytes | None:
    env, dbs = index_env.open_env(path)
    with env.begin() as txn:
        return txn.get(b"k", db=dbs["meta"])


def test_a_removed_cache_directory_gives_its_environment_back(tmp_path):
    kept, removed = str(tmp_path / "kept" / "index"), str(tmp_path / "removed" / "index")
    _put(kept, b"kept")
    _put(removed, b"old")
    shutil.rmtree(tmp_path / "removed")
    # made again at the same path: a new, empty environment, not the one whose files are gone
    assert _get(removed) is None
    _put(removed, b"new")
    assert _get(removed) == b"new" and _get(kept) == b"kept"
    shutil.rmtree(tmp_path / "removed")
    index_env.open_env(kept)
    assert not any(p.startswith(str(tmp_path / "removed")) for p in index_env._envs)

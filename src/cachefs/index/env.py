"""Opening the one LMDB environment of a cache directory.

LMDB forbids opening the same environment twice in one process (locks would be lost), so environments are
shared through a small registry keyed by real path; that registry is the only module-level state in the
index, and it exists because of that LMDB rule. Several *processes* open the same environment freely:
LMDB's reader table and writer lock make that safe.
"""

from __future__ import annotations

import os
import threading

import lmdb

from cachefs.base.errors import CacheFSError, ConfigError

__all__ = ["DB_NAMES", "open_env"]

#: Named databases; see docs/FORMAT.md for each record layout.
DB_NAMES = ("meta", "datasets", "ds_stats", "manifest", "objects", "blocks", "packed", "packs", "pack_members",
            "dir_heat", "guests", "hints", "staged")

# The address space reserved for the map. LMDB files grow only as data is written; the reservation is
# virtual, but it counts against the process's 128 TiB of address space, which a process opening many cache
# directories (a test run, a daemon serving several) must not exhaust: 256 GiB holds index records for billions
# of blocks and manifest entries, and about 500 environments fit in one process.
_MAP_SIZE = 1 << 38

_envs: dict[str, tuple[lmdb.Environment, dict[str, lmdb._Database]]] = {}
_env_files: dict[str, int] = {}  # real path -> inode of its data.mdb when opened
_envs_lock = threading.Lock()


def _forget_removed() -> None:
    """Close the environments whose files were removed (a cache directory deleted while this process ran): their
    address space is given back, and nothing can use them again. Called with the lock held."""
    for real, inode in list(_env_files.items()):
        try:
            alive = os.stat(os.path.join(real, "data.mdb")).st_ino == inode
        except OSError:
            alive = False
        if not alive:
            env, _ = _envs.pop(real)
            del _env_files[real]
            env.close()


def open_env(path: str) -> tuple[lmdb.Environment, dict[str, lmdb._Database]]:
    """The process-wide LMDB environment at ``path`` and its named databases."""
    real = os.path.realpath(path)
    with _envs_lock:
        _forget_removed()  # (first: a directory removed and made again at the same path gets a new environment)
        if real in _envs:
            return _envs[real]
        try:
            os.makedirs(real, mode=0o700, exist_ok=True)
            # sync/metasync off: a kill -9 loses nothing (committed pages are in the page cache) and a power
            # loss at worst loses recent records, whose blocks are then fetched again; the data files are
            # checksummed, so an index that got ahead of its data is caught on read.
            env = lmdb.open(
                real, map_size=_MAP_SIZE, max_dbs=len(DB_NAMES) + 2, max_readers=2048,
                sync=False, metasync=False, readahead=False, meminit=False,
            )
        except lmdb.Error as exc:
            raise CacheFSError(f"cannot open the cache index at {real}: {exc}") from None
        except PermissionError:
            raise ConfigError(f"cache index {real}: permission denied") from None
        dbs = {name: env.open_db(name.encode()) for name in DB_NAMES}
        _envs[real] = (env, dbs)
        _env_files[real] = os.stat(os.path.join(real, "data.mdb")).st_ino
        return env, dbs

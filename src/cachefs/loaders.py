"""URL front doors for the loaders that do not take fsspec URLs themselves (docs/LOADERS.md has the recipes).

- webdataset opens shards through its own ``gopen`` table, not fsspec, and splits URLs on ``::`` (its union of
  shard lists), so a chained ``cachefs::s3://`` URL cannot reach it. :func:`register_webdataset` adds the
  ``cachefs`` scheme to that table: ``wds.WebDataset("cachefs://bucket/shards/train-{0000..0099}.tar")``.
- pyarrow parses URIs natively (``s3://``, ``gs://``, ...), and polars 2 reads only its own object stores and local
  paths. :func:`arrow_dataset` opens a ``cachefs`` URL (a file, a directory or a glob) as a
  ``pyarrow.dataset.Dataset`` over the cache; ``polars.scan_pyarrow_dataset`` takes it as it is.

Both take the storage options every other front door takes (``cachefs={...}``, the origin's options nested in it
or beside it, see :class:`cachefs.fsspec_fs.CacheFileSystem`), so one URL and one options dict mean the same
thing through fsspec, pandas, HF datasets, webdataset, pyarrow and polars.
"""

from __future__ import annotations

import importlib
import io
from typing import Any

import fsspec

from cachefs.base.errors import InvalidURLError, ReadOnlyError

__all__ = ["arrow_dataset", "register_webdataset"]

#: What webdataset reads a shard with (its default, 8 KiB, costs a Python call per 8 KiB of every shard).
SHARD_BUFFER = 1 << 20

_webdataset_options: dict[str, Any] = {}


def register_webdataset(**storage_options: Any) -> None:
    """Let webdataset open ``cachefs://bucket/key`` shard URLs through the node cache (idempotent).

    ``storage_options`` are used for every shard URL webdataset opens afterwards in this process, and in the
    DataLoader workers it forks (a spawned worker calls this again, as it imports webdataset again).
    """
    # (``webdataset.gopen`` the attribute is the function; the module holding the table is only in sys.modules)
    gopen_module = importlib.import_module("webdataset.gopen")

    _webdataset_options.clear()
    _webdataset_options.update(storage_options)
    gopen_module.gopen_schemes["cachefs"] = _open_shard


def _open_shard(url: str, mode: str = "rb", bufsize: int = 8192, **_: Any) -> io.BufferedReader:
    if mode != "rb":
        raise ReadOnlyError(f"{url}: cachefs shards are read-only (mode {mode!r})")
    fs, path = fsspec.core.url_to_fs(url, **_webdataset_options)
    return io.BufferedReader(fs.open(path, "rb"), buffer_size=max(bufsize, SHARD_BUFFER))


def arrow_dataset(url: str, *, format: str = "parquet", **storage_options: Any) -> Any:
    """A ``pyarrow.dataset.Dataset`` of the files at ``url`` (a file, a directory or a glob), read through cachefs.

    ``format`` is any format pyarrow.dataset reads (``parquet``, ``arrow``/``feather``, ``csv``, ``json``).
    """
    import pyarrow.dataset as pds

    if not url.startswith("cachefs"):
        raise InvalidURLError(f"{url}: not a cachefs URL (cachefs://bucket/key or cachefs::s3://bucket/key)")
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    source: str | list[str] = path
    if any(ch in path for ch in "*?["):
        source = sorted(fs.glob(path))
        if not source:
            raise FileNotFoundError(f"{url}: no file matches")
    return pds.dataset(source, format=format, filesystem=fs)

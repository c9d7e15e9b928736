"""Commit records: how a checkpoint directory is published atomically on an object store without rename.

For a directory ``…/P/D`` the uploader first *claims* the name (``…/P/.cachefs/claims/D``, a conditional PUT with
``If-None-Match: *``) before any of D's objects are written, then uploads them, then writes the *commit record*
``…/P/.cachefs/commits/D.json`` last, conditionally too. A reader that trusts only committed checkpoints lists
the records (``cachefs checkpoints URL``): each names every object of its checkpoint with its size and ETag, so a
partial one is never listed. Two writers racing on D: the first claim wins; the other's objects are never
written, and its queue entries fail with :class:`~cachefs.base.errors.CommitConflictError`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from cachefs.base.errors import BucketNotFoundError, CommitConflictError, ObjectNotFoundError
from cachefs.sources import Source
from cachefs.sources.writes import ObjectWrites

__all__ = ["claim", "commit_record_url", "list_commits", "write_record"]

MARKER_DIR = ".cachefs"


def _parent_and_name(url: str) -> tuple[str, str]:
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent, name


def claim_url(dir_url: str) -> str:
    parent, name = _parent_and_name(dir_url)
    return f"{parent}/{MARKER_DIR}/claims/{name}"


def commit_record_url(dir_url: str) -> str:
    parent, name = _parent_and_name(dir_url)
    return f"{parent}/{MARKER_DIR}/commits/{name}.json"


async def _read_json(source: Source, url: str) -> dict[str, Any]:
    entry = await source.stat(url)
    data = await source.read(url, entry.version, 0, entry.size)
    try:
        out = json.loads(bytes(data))
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


async def _conditional_put(writes: ObjectWrites, source: Source, url: str, body: dict[str, Any], writer: str) -> None:
    """Write ``body`` at ``url`` unless an object is there; a record this writer left there itself (a retry after
    a lost answer, or a restart) counts as written."""
    try:
        await writes.put(url, json.dumps(body, indent=1).encode(), if_none_match=True)
    except CommitConflictError:
        try:
            theirs = await _read_json(source, url)
        except ObjectNotFoundError:  # deleted meanwhile: try once more
            await writes.put(url, json.dumps(body, indent=1).encode(), if_none_match=True)
            return
        if theirs.get("writer") != writer:
            raise CommitConflictError(f"{url.rsplit('/', 1)[-1]}: committed by another writer "
                                      f"({theirs.get('writer', 'unknown')}) first") from None


async def claim(writes: ObjectWrites, source: Source, dir_url: str, writer: str) -> None:
    """Claim the checkpoint name ``dir_url`` for ``writer`` before any of its objects is written."""
    url = claim_url(dir_url)
    await _conditional_put(writes, source, url, {"writer": writer, "claimed": time.time()}, writer)
    # A server that does not decide conditional writes atomically can let two racing claims both succeed; the
    # write it keeps is the later one, so the claim is read back and only the writer it names goes on.
    theirs = await _read_json(source, url)
    if theirs.get("writer") != writer:
        raise CommitConflictError(f"{dir_url.rsplit('/', 1)[-1]}: committed by another writer "
                                  f"({theirs.get('writer', 'unknown')}) first")


async def write_record(writes: ObjectWrites, source: Source, dir_url: str, writer: str) -> dict[str, Any]:
    """Write the commit record of the checkpoint at ``dir_url`` (every object under it, listed now); the record."""
    files: list[dict[str, Any]] = []
    try:
        async for batch in source.list_tree(dir_url):
            files.extend({"path": e.path, "size": e.size, "etag": e.version} for e in batch)
    except ObjectNotFoundError:  # an empty checkpoint directory
        pass
    files.sort(key=lambda f: f["path"])
    record = {"name": dir_url.rsplit("/", 1)[-1], "url": dir_url, "writer": writer, "committed": time.time(),
              "files": files, "bytes": sum(f["size"] for f in files)}
    await _conditional_put(writes, source, commit_record_url(dir_url), record, writer)
    return record


async def list_commits(source: Source, url: str) -> list[dict[str, Any]]:
    """The checkpoints committed directly under ``url``, oldest first."""
    prefix = f"{url.rstrip('/')}/{MARKER_DIR}/commits"
    records = []
    try:
        async for batch in source.list_tree(prefix):
            for e in batch:
                if e.path.endswith(".json") and "/" not in e.path:
                    record = await _read_json(source, f"{prefix}/{e.path}")
                    if record.get("files") is not None:
                        records.append(record)
    except BucketNotFoundError:
        raise
    except ObjectNotFoundError:
        return []
    return sorted(records, key=lambda r: r.get("committed", 0))

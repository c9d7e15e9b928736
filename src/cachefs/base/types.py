"""Frozen value types shared by every layer."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from cachefs.base.errors import InvalidURLError

__all__ = ["DatasetRef", "Entry", "canonical_url", "dataset_id", "object_key", "within"]

#: Schemes whose URLs name a bucket-like root; anything fsspec knows is accepted, these are just common.
_OBJECT_STORE_SCHEMES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "r2", "oss"}
#: What an S3 client accepts as a bucket name: today's rules (3-63 of a-z 0-9 . -) plus the upper case and
#: underscores of buckets made before 2018 and by S3-compatible stores; anything else is a typo, told as one.
_S3_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")


@functools.lru_cache(maxsize=65536)
def canonical_url(url: str) -> str:
    """Return the one spelling of a dataset or object URL that ids are computed from.

    ``s3a://`` becomes ``s3://``, a bare path becomes ``file://`` with an absolute path, trailing slashes go.
    Raises :class:`InvalidURLError` for URLs cachefs cannot use.
    """
    if not isinstance(url, str) or not url.strip():
        raise InvalidURLError("empty dataset URL")
    url = url.strip()
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):  # NUL ends a C path; others hide in logs
        raise InvalidURLError(f"{url!r}: control characters are not allowed in dataset URLs")
    if "::" in url:
        raise InvalidURLError(f"{url!r}: give the dataset URL itself, not a chained fsspec URL")
    if "://" not in url:
        if url.startswith("/"):
            url = "file://" + url
        else:
            raise InvalidURLError(f"{url!r}: not a URL (expected e.g. s3://bucket/prefix or file:///path)")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if not scheme.isidentifier() and not scheme.replace("-", "").replace("+", "").isalnum():
        raise InvalidURLError(f"{url!r}: malformed scheme")
    if scheme == "s3a":
        scheme = "s3"
    if scheme == "file":
        import os.path

        if not rest.startswith("/"):
            raise InvalidURLError(f"{url!r}: file URLs need an absolute path (file:///data/set)")
        path = os.path.normpath(rest)
        return "file://" + path
    try:
        parts = urlsplit(f"{scheme}://{rest}")
    except ValueError as exc:  # e.g. an unbalanced "[" in the host
        raise InvalidURLError(f"{url!r}: {exc}") from None
    if scheme in _OBJECT_STORE_SCHEMES and not parts.netloc:
        raise InvalidURLError(f"{url!r}: no bucket name")
    if scheme == "s3" and not _S3_BUCKET.fullmatch(parts.netloc):
        raise InvalidURLError(f"{url!r}: {parts.netloc!r} is not a valid S3 bucket name (letters, digits, '.', "
                              "'-' and '_' only)")
    if parts.query or parts.fragment:
        raise InvalidURLError(f"{url!r}: query strings and fragments are not supported in dataset URLs")
    if any(seg in (".", "..") for seg in parts.path.split("/")):
        raise InvalidURLError(f"{url!r}: '.' and '..' are not allowed in dataset URLs")
    return f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def within(inner: str, outer: str) -> bool:
    """Whether the path or URL ``inner`` is ``outer`` or below it (never below an empty ``outer``)."""
    return bool(outer) and (inner == outer or inner.startswith(outer.rstrip("/") + "/"))


def dataset_id(url: str) -> str:
    """A short, stable id of a canonical dataset URL: 16 lowercase hex digits (a valid label-key fragment)."""
    return hashlib.blake2b(canonical_url(url).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class DatasetRef:
    """A dataset: a URL prefix on an origin, and its id."""

    url: str
    id: str

    @classmethod
    def from_url(cls, url: str) -> DatasetRef:
        canon = canonical_url(url)
        return cls(canon, dataset_id(canon))

    def object_url(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url


@dataclass(frozen=True, slots=True)
class Entry:
    """One manifest entry: a file or directory of a dataset, as it was when the manifest was taken.

    ``path`` is relative to the dataset root, ``/``-separated, with no leading slash ("" is the root).
    ``version`` is the origin's ETag or version id for files ("" for directories).
    """

    path: str
    size: int
    version: str
    mtime: float
    is_dir: bool = False

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def object_key(dataset: str, path: str, version: str) -> bytes:
    """The 16-byte cache key of one version of one object of one dataset."""
    h = hashlib.blake2b(digest_size=16)
    for part in (dataset, path, version):
        b = part.encode()
        h.update(len(b).to_bytes(4, "big"))
        h.update(b)
    return h.digest()

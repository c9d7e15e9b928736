"""Sources of bytes: the origin (S3, local files, any fsspec backend)."""

from __future__ import annotations

from typing import Any

from cachefs.base.config import Config
from cachefs.base.errors import InvalidURLError, translate_origin_error
from cachefs.sources.base import RetryingSource, RetryPolicy, Source, with_retries

__all__ = ["RetryPolicy", "RetryingSource", "Source", "open_object_writes", "open_origin", "open_raw_origin",
           "with_retries"]


def open_origin(url: str, config: Config, storage_options: dict[str, Any] | None = None) -> Source:
    """The origin :class:`Source` for a dataset URL's scheme, with retries, timeouts and error translation."""
    o = config.origin
    return RetryingSource(open_raw_origin(url, config, storage_options),
                          RetryPolicy(o.max_attempts, o.backoff_base, o.backoff_max), o.request_timeout)


def open_object_writes(url: str, config: Config, storage_options: dict[str, Any] | None = None):
    """The :class:`~cachefs.sources.writes.ObjectWrites` for a volume URL: S3 only (writable volumes need
    multipart uploads and conditional writes, which other fsspec backends do not all offer)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("s3", "s3a"):
        raise InvalidURLError(f"{url!r}: writable volumes are on S3 (s3://bucket/prefix); {scheme}:// is read-only")
    from cachefs.sources.s3 import S3Source
    from cachefs.sources.writes import S3ObjectWrites

    o = config.origin
    return S3ObjectWrites(S3Source(o, config.engine, storage_options),
                          RetryPolicy(o.max_attempts, o.backoff_base, o.backoff_max), o.request_timeout)


def open_raw_origin(url: str, config: Config, storage_options: dict[str, Any] | None = None) -> Source:
    """The bare origin source for a URL's scheme (one attempt per request; see :class:`RetryingSource`)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("s3", "s3a"):
        from cachefs.sources.s3 import S3Source

        return S3Source(config.origin, config.engine, storage_options)
    if scheme in ("file", "local"):
        from cachefs.sources.local import LocalSource

        return LocalSource()
    import fsspec

    if scheme not in fsspec.available_protocols():
        raise InvalidURLError(f"{url!r}: unknown scheme {scheme!r} (s3://, gs://, file:// and other fsspec protocols work)")
    from cachefs.sources.generic import FsspecSource

    try:
        return FsspecSource(scheme, config.origin, storage_options, url=url)
    except ImportError as exc:
        raise InvalidURLError(f"{url!r}: the {scheme}:// backend is not installed ({exc.msg or exc.name})") from None
    except OSError as exc:  # a backend that connects as it starts (ftp://, sftp://): the origin's failure
        raise translate_origin_error(exc, url) from None
    except Exception as exc:  # noqa: BLE001 - a backend refusing its arguments: a bad URL or option, said in one line
        raise InvalidURLError(f"{url!r}: cannot open the {scheme}:// file system ({type(exc).__name__}: {exc})"
                              ) from None

"""The cachefs exception tree.

Every error cachefs raises is a :class:`CacheFSError`, which is an :class:`OSError` with a meaningful
``errno``: callers that already handle ``OSError`` (pandas, pyarrow, plain ``open``) keep working, and the
FUSE edge can answer with ``err.errno`` without a second table. Origin errors (S3 codes, HTTP statuses,
fsspec exceptions) are turned into this tree exactly once, in :func:`translate_origin_error`.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Iterator

__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "CacheFSError",
    "CacheFullError",
    "CommitConflictError",
    "ConfigError",
    "CorruptBlockError",
    "CredentialsError",
    "InvalidURLError",
    "ObjectNotFoundError",
    "OriginError",
    "OriginUnavailableError",
    "ReadOnlyError",
    "StaleObjectError",
    "ThrottledError",
    "TransientOriginError",
    "TruncatedBodyError",
    "bucket_of",
    "translate_origin_error",
]


class CacheFSError(OSError):
    """Root of every error cachefs raises; ``errno`` says what kind of failure it is."""

    default_errno = errno.EIO
    #: True when retrying the same request may succeed (throttling, 5xx, timeouts, truncated bodies).
    retryable = False

    def __init__(self, message: str, *, errno_: int | None = None) -> None:
        super().__init__(errno_ if errno_ is not None else self.default_errno, message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # keep the message intact across pickling (multiprocessing, pytest-xdist)
        return (self.__class__, (self.message,))


class ObjectNotFoundError(CacheFSError, FileNotFoundError):
    default_errno = errno.ENOENT


class BucketNotFoundError(ObjectNotFoundError):
    """The bucket itself does not exist (not only the object or prefix asked for)."""


class AccessDeniedError(CacheFSError, PermissionError):
    default_errno = errno.EACCES


class CredentialsError(AccessDeniedError):
    """No usable credentials, or the origin rejected them."""


class InvalidURLError(CacheFSError, ValueError):
    default_errno = errno.EINVAL


class ConfigError(CacheFSError, ValueError):
    default_errno = errno.EINVAL


class StaleObjectError(CacheFSError):
    """The origin object changed after the manifest was taken; its old bytes are not available."""

    default_errno = errno.ESTALE


class OriginError(CacheFSError):
    """The origin failed in a way that is not one of the more specific cases."""


class OriginUnavailableError(OriginError):
    """The origin endpoint cannot be reached (connection refused, DNS failure)."""

    default_errno = errno.EHOSTUNREACH
    retryable = True


class ThrottledError(OriginError):
    """503 SlowDown and friends: back off and retry."""

    default_errno = errno.EAGAIN
    retryable = True


class TransientOriginError(OriginError):
    """5xx, timeouts, reset connections: retry with backoff."""

    retryable = True


class TruncatedBodyError(TransientOriginError):
    """The origin sent fewer bytes than the range asked for."""


class CorruptBlockError(CacheFSError):
    """A cached block failed its checksum; it is dropped and fetched again."""

    default_errno = errno.EBADMSG
    #: The block that failed, when one did.
    block: int | None = None


class CacheFullError(CacheFSError):
    """The cache disk is full and eviction could not make room."""

    default_errno = errno.ENOSPC


class CommitConflictError(CacheFSError):
    """Another writer committed (or claimed) a checkpoint of the same name first."""

    default_errno = errno.EEXIST


class ReadOnlyError(CacheFSError):
    default_errno = errno.EROFS


# (S3 error code or HTTP status) -> our class. Codes are the ones S3 documents in its error responses.
_S3_CODES: dict[str, type[CacheFSError]] = {
    "NoSuchKey": ObjectNotFoundError,
    "NoSuchBucket": BucketNotFoundError,
    "NotFound": ObjectNotFoundError,
    "404": ObjectNotFoundError,
    "AccessDenied": AccessDeniedError,
    "AllAccessDisabled": AccessDeniedError,
    "403": AccessDeniedError,
    "InvalidAccessKeyId": CredentialsError,
    "SignatureDoesNotMatch": CredentialsError,
    "ExpiredToken": CredentialsError,
    "InvalidToken": CredentialsError,
    "PreconditionFailed": StaleObjectError,
    "412": StaleObjectError,
    "InvalidRange": StaleObjectError,  # the object shrank under us
    "416": StaleObjectError,
    "SlowDown": ThrottledError,
    "Throttling": ThrottledError,
    "ThrottlingException": ThrottledError,
    "RequestLimitExceeded": ThrottledError,
    "TooManyRequests": ThrottledError,
    "429": ThrottledError,
    "503": ThrottledError,
    "ServiceUnavailable": ThrottledError,
    "InternalError": TransientOriginError,
    "500": TransientOriginError,
    "502": TransientOriginError,
    "504": TransientOriginError,
    "RequestTimeout": TransientOriginError,
    "RequestTimeTooSkewed": CredentialsError,
}


def bucket_of(url: str) -> str:
    """The bucket (host part) of an object URL, as said in messages."""
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0] or url


def _client_error_codes(exc: BaseException) -> list[str]:
    """The S3 error code and the HTTP status of a botocore-style error, most specific first."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return []
    codes = [response.get("Error", {}).get("Code"), response.get("ResponseMetadata", {}).get("HTTPStatusCode")]
    return [str(c) for c in codes if c]


def _walk_causes(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def translate_origin_error(exc: BaseException, what: str) -> CacheFSError:
    """Turn any exception raised while talking to the origin into one of ours.

    ``what`` names the object or operation for the message (never credentials).
    """
    if isinstance(exc, CacheFSError):
        return exc
    for cause in _walk_causes(exc):
        codes = _client_error_codes(cause)
        if not codes:
            continue
        for code in codes:
            cls = _S3_CODES.get(code)
            if cls is None and code.isdigit() and int(code) >= 500:
                cls = TransientOriginError
            if cls is StaleObjectError:
                return cls(f"{what}: changed at the origin since the manifest was taken ({codes[0]})")
            if cls is BucketNotFoundError:
                return cls(f"{what}: bucket {bucket_of(what)} not found: it does not exist ({codes[0]})")
            if cls is not None:
                return cls(f"{what}: {codes[0]}")
        return OriginError(f"{what}: origin error {codes[0]}")
    name = type(exc).__name__
    for cause in _walk_causes(exc):
        cname = type(cause).__name__
        if cname == "ValueError" and str(cause).startswith("Invalid endpoint"):  # botocore's, for AWS_ENDPOINT_URL too
            return InvalidURLError(f"{what}: the S3 endpoint is not a URL ({cause}); check --endpoint-url or "
                                   "AWS_ENDPOINT_URL")
        if cname in ("NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError"):
            return CredentialsError(f"{what}: no credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")
        if cname == "ProfileNotFound":
            return CredentialsError(f"{what}: {cause}")
        if cname in ("EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError", "ClientConnectorDNSError",
                     "gaierror"):
            return OriginUnavailableError(f"{what}: cannot reach the origin endpoint ({cname})")
        if isinstance(cause, (asyncio.TimeoutError, TimeoutError)) or cname in (
            "ReadTimeoutError", "ConnectTimeoutError", "ServerTimeoutError",
        ):
            return TransientOriginError(f"{what}: timed out")
        if cname in ("ResponseStreamingError", "ClientPayloadError", "IncompleteReadError", "ServerDisconnectedError",
                     "ClientOSError", "ContentLengthError", "ConnectionResetError", "BrokenPipeError"):
            return TruncatedBodyError(f"{what}: connection dropped mid-body ({cname})")
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{what}: not found")
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"{what}: permission denied")
    if isinstance(exc, OSError) and exc.errno is not None:
        return OriginError(f"{what}: {exc.strerror or name}", errno_=exc.errno)
    return OriginError(f"{what}: {name}: {exc}")

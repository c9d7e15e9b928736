"""Writing objects to the origin: what the checkpoint uploader needs, and nothing of the read path's.

:class:`ObjectWrites` is the seam; :class:`S3ObjectWrites` implements it over the same aiobotocore client the
S3 source reads with. Every call retries transient failures with the sources' one backoff policy and error table
(:func:`~cachefs.sources.base.with_retries`); a conditional write that loses raises
:class:`~cachefs.base.errors.CommitConflictError`.
"""

from __future__ import annotations

import abc
from typing import Any

from cachefs.base.errors import CommitConflictError, InvalidURLError, StaleObjectError
from cachefs.sources.base import RetryPolicy, with_retries

__all__ = ["MAX_COPY", "ObjectWrites", "S3ObjectWrites"]

#: The largest object one CopyObject may copy (S3's limit); larger ones are copied part by part.
MAX_COPY = 5 * 1024 * 1024 * 1024


class ObjectWrites(abc.ABC):
    """Whole-object writes at the origin: single PUTs, multipart uploads, server-side copies and deletes."""

    @abc.abstractmethod
    async def put(self, url: str, data: bytes | memoryview, *, if_none_match: bool = False) -> str:
        """Write the object whole; its ETag. ``if_none_match``: only if no object of that name exists."""

    @abc.abstractmethod
    async def start_multipart(self, url: str) -> str:
        """Begin a multipart upload; its upload id."""

    @abc.abstractmethod
    async def put_part(self, url: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        """Upload part ``number`` (1-based); its ETag."""

    @abc.abstractmethod
    async def complete_multipart(self, url: str, upload_id: str, etags: list[str]) -> str:
        """Make the object appear whole from its parts (in order); its ETag."""

    @abc.abstractmethod
    async def abort_multipart(self, url: str, upload_id: str) -> None:
        """Drop an unfinished multipart upload and its parts (gone already: fine)."""

    @abc.abstractmethod
    async def unfinished_multipart(self, url: str) -> list[str]:
        """The ids of the multipart uploads begun for exactly this object and not completed or aborted."""

    @abc.abstractmethod
    async def copy(self, src: str, dst: str, size: int, *, if_match: str = "") -> str:
        """Copy the object at ``src`` (``size`` bytes) to ``dst`` on the origin; the copy's ETag. ``if_match``:
        only if ``src`` still has that ETag (:class:`~cachefs.base.errors.StaleObjectError` otherwise, or
        :class:`~cachefs.base.errors.ObjectNotFoundError` when it is gone)."""

    @abc.abstractmethod
    async def delete(self, url: str) -> None:
        """Delete the object (missing already: fine)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def _split(url: str) -> tuple[str, str]:
    rest = url.split("://", 1)[1] if "://" in url else ""
    bucket, _, key = rest.partition("/")
    if not bucket or not key:
        raise InvalidURLError(f"{url!r}: not an object URL (s3://bucket/key)")
    return bucket, key


class S3ObjectWrites(ObjectWrites):
    """S3 writes through the S3 source's client (endpoint and credentials resolve as for reads)."""

    def __init__(self, source: Any, policy: RetryPolicy, timeout: float) -> None:
        self._source = source  # a cachefs.sources.s3.S3Source
        self._policy = policy
        self._timeout = timeout

    async def _call(self, what: str, kind: str, op: str, nbytes: int = 0, **kw: Any) -> dict:
        client = await self._source.client()
        # A timeout that grows with the body: a 16 MiB part at 10 MB/s is not a hung request.
        timeout = self._timeout + nbytes / (10 * 1024 * 1024)
        return await with_retries(lambda: getattr(client, op)(**kw), what=what, policy=self._policy,
                                  timeout=timeout, kind=kind)

    async def _conditional(self, url: str, op: str, nbytes: int, **kw: Any) -> dict:
        try:
            return await self._call(url, "put", op, nbytes, IfNoneMatch="*", **kw)
        except StaleObjectError:  # 412: an object of that name exists
            raise CommitConflictError(f"{url}: already exists (another writer committed it first)") from None

    async def put(self, url: str, data: bytes | memoryview, *, if_none_match: bool = False) -> str:
        bucket, key = _split(url)
        body = bytes(data)
        if if_none_match:
            resp = await self._conditional(url, "put_object", len(body), Bucket=bucket, Key=key, Body=body)
        else:
            resp = await self._call(url, "put", "put_object", len(body), Bucket=bucket, Key=key, Body=body)
        return str(resp.get("ETag", "")).strip('"')

    async def start_multipart(self, url: str) -> str:
        bucket, key = _split(url)
        resp = await self._call(url, "put", "create_multipart_upload", Bucket=bucket, Key=key)
        return str(resp["UploadId"])

    async def put_part(self, url: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        bucket, key = _split(url)
        body = bytes(data)
        resp = await self._call(f"{url} part {number}", "put", "upload_part", len(body), Bucket=bucket, Key=key,
                                UploadId=upload_id, PartNumber=number, Body=body)
        return str(resp["ETag"])

    async def complete_multipart(self, url: str, upload_id: str, etags: list[str]) -> str:
        bucket, key = _split(url)
        parts = {"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]}
        resp = await self._call(url, "put", "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                                MultipartUpload=parts)
        return str(resp.get("ETag", "")).strip('"')

    async def abort_multipart(self, url: str, upload_id: str) -> None:
        bucket, key = _split(url)
        try:
            await self._call(url, "put", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except FileNotFoundError:  # NoSuchUpload: completed or aborted before
            pass

    async def unfinished_multipart(self, url: str) -> list[str]:
        bucket, key = _split(url)
        found: list[str] = []
        page: dict[str, Any] = {}
        while True:
            resp = await self._call(url, "list", "list_multipart_uploads", Bucket=bucket, Prefix=key, **page)
            for u in resp.get("Uploads", []):
                if u.get("Key") == key:
                    found.append(str(u["UploadId"]))
            if not resp.get("IsTruncated"):
                return found
            page = {"KeyMarker": resp.get("NextKeyMarker", ""), "UploadIdMarker": resp.get("NextUploadIdMarker", "")}

    async def copy(self, src: str, dst: str, size: int, *, if_match: str = "") -> str:
        sb, sk = _split(src)
        db, dk = _split(dst)
        condition: dict[str, Any] = {"CopySourceIfMatch": f'"{if_match}"'} if if_match else {}
        if size <= MAX_COPY:
            resp = await self._call(f"copy {src} to {dst}", "put", "copy_object", Bucket=db, Key=dk,
                                    CopySource={"Bucket": sb, "Key": sk}, **condition)
            return str(resp.get("CopyObjectResult", {}).get("ETag", "")).strip('"')
        upload_id = await self.start_multipart(dst)
        try:
            etags = []
            part = MAX_COPY
            for number, start in enumerate(range(0, size, part), 1):
                resp = await self._call(f"copy {src} to {dst}", "put", "upload_part_copy", Bucket=db, Key=dk,
                                        UploadId=upload_id, PartNumber=number, CopySource={"Bucket": sb, "Key": sk},
                                        CopySourceRange=f"bytes={start}-{min(size, start + part) - 1}", **condition)
                etags.append(str(resp["CopyPartResult"]["ETag"]))
            return await self.complete_multipart(dst, upload_id, etags)
        except BaseException:
            await self.abort_multipart(dst, upload_id)
            raise

    async def delete(self, url: str) -> None:
        bucket, key = _split(url)
        try:
            await self._call(url, "put", "delete_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            pass

    async def close(self) -> None:
        await self._source.close()

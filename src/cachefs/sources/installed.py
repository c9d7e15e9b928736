"""Whether the installed s3fs and fsspec go together.

s3fs pins the fsspec release it was made with. ``pip install cachefs`` picks a matching pair, but a later ``pip
install`` of a library that caps fsspec (HF ``datasets`` does) moves fsspec alone and leaves an s3fs that needs
another fsspec: S3 then fails somewhere deep inside s3fs. We say so in one line instead, with the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from packaging.requirements import Requirement

__all__ = ["s3fs_fsspec_mismatch"]


def s3fs_fsspec_mismatch(version: Callable[[str], str] = metadata.version,
                         requires: Callable[[str], list[str] | None] = metadata.requires) -> str | None:
    """None when the installed s3fs accepts the installed fsspec, else a one-line reason with the fix."""
    try:
        s3fs_version, fsspec_version = version("s3fs"), version("fsspec")
        needs = [Requirement(r) for r in requires("s3fs") or []]
    except metadata.PackageNotFoundError:
        return None  # (not installed: the import says so)
    for req in needs:
        if req.name == "fsspec" and (req.marker is None or req.marker.evaluate()):
            if not req.specifier.contains(fsspec_version, prereleases=True):
                return (f"s3fs {s3fs_version} needs fsspec{req.specifier} but fsspec {fsspec_version} is installed "
                        f"(a later pip install moved one of them): pip install 's3fs=={fsspec_version}', or install "
                        "cachefs and your data loaders in one pip command (docs/LOADERS.md)")
    return None

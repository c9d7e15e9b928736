"""The ``cachefs`` fsspec protocol: ``fsspec.open("cachefs::s3://bucket/key", cachefs={...}, s3={...})``.

Registered through the ``fsspec.specs`` entry point, so pandas, pyarrow and anything else that takes fsspec
URLs can read through the node cache. Listing and ``info`` come from the dataset's frozen manifest (no
origin request once the manifest exists); reads of cached ranges are served straight from the local cache
files in the calling thread, and misses go through the engine.

Which dataset a path belongs to: the ``dataset=`` option if given; else the dataset on this node whose URL
is the longest prefix of the path (e.g. one ``cachefs prefetch`` took); else a new dataset rooted at the
path (for listings) or at its parent directory (for files).

Options (``cachefs={...}``): ``dataset``, ``manifest_version`` (pin a snapshot), ``cache_dir``, ``config``
(a YAML file) and any config key as ``section_field`` (e.g. ``engine_memory_budget="1GiB"``).

With ``writable=True`` (S3 only) the filesystem also writes: ``open(..., "wb")``, ``put``, ``pipe``, ``rm``,
``mv``, ``mkdir``, ``touch`` go to this process's checkpoint volume (:mod:`cachefs.write.files`): durable on the
node at close, on the origin in the background in close order; ``volume="s3://bucket/prefix"`` confines them to
that prefix (default: the bucket). Files this process wrote are read back from the node.
"""

from cachefs.fsspec_fs.file import CacheFile
from cachefs.fsspec_fs.filesystem import CacheFileSystem

__all__ = ["CacheFile", "CacheFileSystem"]

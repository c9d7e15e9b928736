"""The LMDB node index (the only importer of ``lmdb``)."""

from .index import DatasetRecord, DatasetStats, Index, ManifestInfo
from .records import FORMAT_VERSION, ObjectRecord

__all__ = ["FORMAT_VERSION", "DatasetRecord", "DatasetStats", "Index", "ManifestInfo", "ObjectRecord"]

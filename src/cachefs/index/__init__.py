"""The LMDB node index (the only importer of ``lmdb``)."""

from cachefs.index.index import DatasetRecord, DatasetStats, Index, ManifestInfo
from cachefs.index.records import FORMAT_VERSION, ObjectRecord

__all__ = ["FORMAT_VERSION", "DatasetRecord", "DatasetStats", "Index", "ManifestInfo", "ObjectRecord"]

"""The LMDB node index (the only importer of ``lmdb``)."""

from .index import DatasetRecord, DatasetStats, Index, ManifestInfo
from .records import FORMAT_VERSION, ObjectRecord

__all__ = ["Index", "DatasetRecord", "DatasetStats", "ManifestInfo", "ObjectRecord", "FORMAT_VERSION"]

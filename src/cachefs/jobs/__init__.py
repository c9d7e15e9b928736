"""Jobs that run over a whole dataset through the engine: warming the cache (``cachefs prefetch``) and
writing a packed mirror (``cachefs pack``)."""

from cachefs.jobs.warm import Progress, select_files, warm
from cachefs.jobs.write_mirror import MirrorSummary, write_mirror

__all__ = ["MirrorSummary", "Progress", "select_files", "warm", "write_mirror"]

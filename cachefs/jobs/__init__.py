"""Jobs that run over a whole dataset through the engine: warming the cache (``cachefs prefetch``) and
writing a packed mirror (``cachefs pack``)."""

from cachefs.jobs.pack import MirrorSummary, write_mirror
from cachefs.jobs.warm import Progress, select_files, warm

__all__ = ["MirrorSummary", "Progress", "select_files", "warm", "write_mirror"]

"""Jobs that run over a whole dataset through the engine: warming the cache (``cachefs prefetch``) and
writing a packed mirror (``cachefs pack``)."""

from .pack import MirrorSummary, write_mirror
from .warm import Progress, select_files, warm

__all__ = ["MirrorSummary", "Progress", "select_files", "warm", "write_mirror"]

"""Warming the cache ahead of readers."""

from .warmup import Progress, select_files, warm

__all__ = ["Progress", "select_files", "warm"]

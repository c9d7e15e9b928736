"""The node's epoch scans as admission and eviction see them: this process's own (:class:`~cachefs.node.scan.ScanDetector`,
through :class:`~cachefs.node.read_stats.ReadStats`) and every other process's, published in the index
(:class:`~cachefs.index.hints.HintStore`). Read back at most once a second, published at most once a second.
"""

from __future__ import annotations

import logging
import time

from cachefs.base.errors import CacheFSError
from cachefs.index.hints import HintStore, ScanRecord
from cachefs.node.read_stats import ReadStats

__all__ = ["ScanView"]

log = logging.getLogger(__name__)


class ScanView:
    """``enabled`` False (``cache.scan_admission`` off): no dataset is ever scanned."""

    def __init__(self, hints: HintStore, stats: ReadStats, *, enabled: bool) -> None:
        self.hints, self.stats, self.enabled = hints, stats, enabled
        self._scans: dict[str, ScanRecord] = {}  # as last read from the index
        self._read_at = self._published_at = 0.0

    def scans(self) -> dict[str, ScanRecord]:
        """The datasets read as epoch scans on this node (any process), re-read from the index once a second."""
        if not self.enabled:
            return {}
        now = time.monotonic()
        if now - self._read_at > 1.0:
            self._read_at = now
            try:
                published = self.hints.scans()
            except CacheFSError as exc:
                log.debug("scans not read: %s", exc)
                published = self._scans
            # (this process's own, before its next publishing)
            self._scans = {**self.stats.scan_records(), **published}
        return self._scans

    def scanning(self, dataset: str) -> bool:
        return dataset in self.scans()

    def since(self, dataset: str) -> float | None:
        """When the scan of ``dataset`` began; None if it is not scanned."""
        scan = self.scans().get(dataset)
        return None if scan is None else scan.since

    def publish(self) -> None:
        """Publish this process's scans (at most once a second)."""
        now = time.monotonic()
        if now - self._published_at < 1.0:
            return
        self._published_at = now
        records = self.stats.scan_records()
        if records:
            try:
                self.hints.note_scans(records)
            except CacheFSError as exc:
                log.debug("scans not published: %s", exc)
            self._read_at = 0.0  # read them back with the others' at the next look

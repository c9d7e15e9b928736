"""Where the publisher learns what this node holds: one small interface, implemented by the cachefs index
(and by a fake in tests)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from scheduler_hints.labels import DatasetCache, NodeCacheSummary, group_totals

if TYPE_CHECKING:
    from cachefs.status.summary import NodeSummary

__all__ = ["IndexSummary", "StaticSummary", "SummarySource"]


class SummarySource(abc.ABC):
    @abc.abstractmethod
    def summary(self) -> NodeCacheSummary:
        """Per-dataset cached/total bytes and the node's free cache space, now."""


class IndexSummary(SummarySource):
    """Reads the node's cachefs index (the same figures ``cachefs status --json`` prints)."""

    def __init__(self, config, cache_group: str | None = None, *, node: str = "", group_datasets=None) -> None:
        """``group_datasets()``: what the group's members hold ({node: {dataset id: (cached, total)}}, from their
        Node annotations); with it the summary carries the group's figures too, this node's taken from its index
        (fresher than its own annotation)."""
        self._config = config
        self._group = cache_group
        self._self = node
        self._group_datasets = group_datasets
        self._node: NodeSummary | None = None

    def summary(self) -> NodeCacheSummary:
        from cachefs.base.errors import ObjectNotFoundError
        from cachefs.status.summary import NodeSummary

        if self._node is None:
            try:
                self._node = NodeSummary(self._config)
            except ObjectNotFoundError:  # nothing cached on this node yet: nothing to advertise
                return NodeCacheSummary((), 0, 0, 0, self._group)
        rep = self._node.report()
        datasets = tuple(DatasetCache(d["url"], d["id"], d["cached_bytes"], d["total_bytes"], d["manifest_version"],
                                      d.get("guest_bytes", 0), d.get("files", 0)) for d in rep["datasets"])
        free = max(0, min(rep["capacity_bytes"] - rep["used_bytes"], rep["disk_free_bytes"] - rep["min_free_bytes"]))
        group: tuple[DatasetCache, ...] = ()
        if self._group and self._group_datasets is not None:
            members = self._group_datasets()
            members[self._self] = {d.id: (d.cached_bytes - d.guest_bytes, d.total_bytes) for d in datasets}
            group = group_totals(members)
        return NodeCacheSummary(datasets, free, rep["capacity_bytes"], rep["used_bytes"], self._group, group)


class StaticSummary(SummarySource):
    """A summary set by hand: for tests, and for ``cachefs labels`` to show the contract."""

    def __init__(self, summary: NodeCacheSummary) -> None:
        self.current = summary

    def summary(self) -> NodeCacheSummary:
        return self.current

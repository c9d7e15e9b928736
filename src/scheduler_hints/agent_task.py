"""The label publisher as a task of ``cachefs agent`` (entry point ``cachefs.agent_tasks``): the node pod's one
long-running process keeps its node's cache-locality labels current (docs/LABELS.md). Registered from this
package, so that cachefs never imports it."""

from __future__ import annotations

import logging

__all__ = ["publish_labels"]

log = logging.getLogger(__name__)

#: Seconds between checks, and at most one PATCH per MIN_INTERVAL (as `cachefs publish-labels` defaults).
INTERVAL, MIN_INTERVAL = 10.0, 30.0


async def publish_labels(ctx) -> None:
    """``ctx``: cachefs.agent.AgentContext (config, node, group, kube). Without an API client (static
    ``--peers`` and a shared secret) there are no node labels to publish."""
    if ctx.kube is None:
        log.info("no Kubernetes API: node labels are not published")
        return
    from scheduler_hints.publisher import Publisher
    from scheduler_hints.summary import IndexSummary

    summary = IndexSummary(ctx.config, ctx.group, node=ctx.node, group_datasets=ctx.group_datasets)
    await Publisher(ctx.kube, ctx.node, summary, min_interval=MIN_INTERVAL).run(INTERVAL)

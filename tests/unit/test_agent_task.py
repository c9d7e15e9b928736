"""The label publisher joins `cachefs agent` through the cachefs.agent_tasks entry point (so cachefs never imports
scheduler_hints); without an API client it publishes nothing and ends."""

from __future__ import annotations

import asyncio
from importlib.metadata import entry_points
from types import SimpleNamespace


def test_the_label_publisher_is_an_agent_task():
    tasks = {ep.name: ep.value for ep in entry_points(group="cachefs.agent_tasks")}
    assert tasks.get("labels") == "scheduler_hints.agent_task:publish_labels"


def test_without_the_api_it_publishes_nothing_and_ends():
    from scheduler_hints.agent_task import publish_labels

    ctx = SimpleNamespace(config=None, node="n1", group="", engine=None, table=None, kube=None)
    asyncio.run(asyncio.wait_for(publish_labels(ctx), 5))

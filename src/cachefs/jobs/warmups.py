"""CacheDataset warm-ups on this node, a task of ``cachefs agent`` (entry point ``cachefs.agent_tasks``;
docs/DATASETS.md).

Every few seconds the agent lists the CacheDatasets whose ``spec.warmup.enabled`` is set and whose placement
(``cacheGroup``, ``nodeSelector``) includes its Node, and runs a warm-up (:func:`cachefs.jobs.warm.warm`) for each:
resumable by construction (what is cached is skipped), so an agent that restarts simply starts again. In a cache
group each member warms the files whose placement key (a small file's directory window, a large file's first block)
it owns, and fetches the rest of a large file through the group as a reader would: the origin is read about once per
byte. A warm-up whose dataset is deleted, turned off or placed elsewhere is cancelled.

A finished warm-up runs again when the node holds a newer manifest of its dataset (a ``cachefs refresh``, or the
group's listing of it), and at each time of ``spec.warmup.schedule`` (cron, UTC) the node that lists the dataset for
its group (every node outside a group) lists the source again first: the group lists once per schedule, and every
member then warms what is new to it.

The same look takes the datasets the scheduler extender asks this node's cache group to warm for pending gangs that
will land in it (the ConfigMap ``cachefs-system/cachefs-warm-for``; scheduler_hints.prewarm), warmed the same way
(with the credentials of a CacheDataset of the same URL, if any, else the node's own) until the extender drops them.

The same look keeps the node's pins (eviction passes a pinned dataset over) equal to the CacheDatasets with
``spec.pin`` placed on this node.

Progress is this node's annotation ``warm.cachefs.io/<dataset id>`` (JSON: ``state`` running, done or failed,
``filesDone``, ``filesTotal``, ``bytesDone``, ``bytesTotal``, ``errors``, ``reason``), which the dataset controller
adds up into the object's status. Credentials: the dataset's ``credentialsSecret`` in its namespace
(``awsAccessKeyID``, ``awsSecretAccessKey``), which the node agents may read only where a Role grants them that
Secret (docs/DATASETS.md), else the node's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from croniter import croniter

from cachefs.base.metrics import WARMUP_BYTES, WARMUP_FILES, WARMUP_RUNNING
from cachefs.base.types import dataset_id, object_key
from cachefs.cluster.cachedatasets import API, WARM_FOR, placed_on, secret_credentials, warm_key
from cachefs.cluster.keys import DirectoryWindows, block_key, manifest_key
from cachefs.jobs.warm import Progress, warm

__all__ = ["Warmups", "next_run", "schedule_problem", "warm_datasets"]

log = logging.getLogger(__name__)

#: Seconds between looks at the CacheDatasets, and at most one progress PATCH per warm-up this often.
POLL, REPORT_EVERY = 5.0, 3.0
#: The source of the pins this task sets in the index (``cachefs pin`` sets ``cli``).
PIN_SOURCE = "cachedatasets"


class Warmups:
    """The warm-ups of one node (``ctx``: cachefs.agent.AgentContext)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self._running: dict[str, tuple[str, asyncio.Task]] = {}  # object uid -> (what it warms, the task)
        self._warmed: dict[str, int] = {}  # object uid -> the manifest version its last warm-up warmed
        self._listed_at: dict[str, float] = {}  # object uid -> when its schedule last listed the source (or began)
        #: Wall-clock seconds (cron schedules are in UTC wall time).
        self.clock: Callable[[], float] = time.time
        self._said_forbidden = False
        self._said_warm_for = False

    async def run(self) -> None:
        try:
            while True:
                with contextlib.suppress(Exception):
                    await self.once()
                await asyncio.sleep(POLL)
        finally:
            for _, task in self._running.values():
                task.cancel()

    async def once(self) -> None:
        kube = self.ctx.kube
        try:
            objs = (await kube.get(f"{API}/cachedatasets")).get("items") or []
        except Exception as exc:
            if not self._said_forbidden:
                log.warning("CacheDatasets not readable (%s): no warm-ups on this node", exc)
                self._said_forbidden = True
            raise
        node = await kube.get(f"/api/v1/nodes/{self.ctx.node}")
        await asyncio.to_thread(self._pin, objs, node)
        wanted: dict[str, tuple[str, Mapping[str, Any]]] = {}
        for obj in objs:
            spec, meta = obj.get("spec") or {}, obj.get("metadata") or {}
            if (spec.get("warmup") or {}).get("enabled") and placed_on(spec, node):
                what = json.dumps([spec.get("url"), spec.get("include"), spec.get("exclude"),
                                   (spec.get("warmup") or {}).get("include"), meta.get("generation")], sort_keys=True)
                wanted[str(meta.get("uid"))] = (what, obj)
        for url in await self._warm_for_group():  # (pending gangs that will land in this node's group)
            if any((o.get("spec") or {}).get("url") == url for _, o in wanted.values()):
                continue
            like: Mapping[str, Any] = next((o for o in objs if (o.get("spec") or {}).get("url") == url), {})
            spec = {**(like.get("spec") or {}), "url": url, "warmup": {"enabled": True}}  # (its credentials too)
            meta = {"uid": f"warm-for/{url}", "namespace": (like.get("metadata") or {}).get("namespace", "default")}
            wanted[meta["uid"]] = (json.dumps([url, "warm-for"]), {"spec": spec, "metadata": meta})
        for uid, (what, task) in list(self._running.items()):
            if uid not in wanted or wanted[uid][0] != what:
                task.cancel()
                del self._running[uid]
        for uid, (what, obj) in wanted.items():
            running = self._running.get(uid)
            if running is None or (running[1].done() and running[1].exception() is not None):
                self._running[uid] = (what, asyncio.ensure_future(self._warm(uid, obj)))
            elif running[1].done() and (again := self._again(uid, obj)) is not None:
                self._running[uid] = (what, asyncio.ensure_future(self._warm(uid, obj, refresh=again)))

    async def _warm_for_group(self) -> list[str]:
        """The dataset URLs the scheduler extender asks this node's cache group to warm, for gangs that will land
        in it (:data:`~cachefs.cluster.cachedatasets.WARM_FOR`); none outside a group or without that ConfigMap."""
        if not self.ctx.group:
            return []
        try:
            data = (await self.ctx.kube.get(WARM_FOR)).get("data") or {}
            urls = json.loads(data.get(self.ctx.group) or "[]")
        except Exception as exc:  # noqa: BLE001 - (none written yet, or not readable: no such warm-ups)
            if "404" not in str(exc) and not self._said_warm_for:
                log.info("the warm-ups for pending gangs are not readable (%s)", exc)
                self._said_warm_for = True
            return []
        return [u for u in urls if isinstance(u, str)] if isinstance(urls, list) else []

    def _again(self, uid: str, obj: Mapping[str, Any]) -> bool | None:
        """Whether a finished warm-up runs again: False when the node now holds a newer manifest of its dataset (a
        refresh of the source, here or by the group's member that lists it), True when its ``warmup.schedule`` is
        due and this node lists the dataset for its group (the source is listed again first), else None."""
        from cachefs.engine import get_engine

        spec = obj.get("spec") or {}
        ds_id = dataset_id(str(spec["url"]))
        rec = (self.ctx.engine or get_engine(self.ctx.config)).index.dataset(ds_id)
        if rec is not None and uid in self._warmed and rec.current != self._warmed[uid]:
            return False
        schedule = (spec.get("warmup") or {}).get("schedule")
        if not schedule or schedule_problem(schedule) or not self._lists_for_group(ds_id):
            return None
        since = self._listed_at.setdefault(uid, self.clock())
        return True if next_run(schedule, since) <= self.clock() else None

    def _lists_for_group(self, ds_id: str) -> bool:
        """Whether this node lists ``ds_id`` for its cache group (its manifest's owner; any node outside a group):
        the others take the new manifest from it and warm up on seeing it."""
        table = self.ctx.table
        if table is None or not self.ctx.group:
            return True
        return table.placement.owner(manifest_key(ds_id)) in (self.ctx.node, None)

    async def _warm(self, uid: str, obj: Mapping[str, Any], *, refresh: bool = False) -> None:
        from cachefs.engine import get_engine

        spec, meta = obj.get("spec") or {}, obj.get("metadata") or {}
        url = str(spec["url"])
        ds_id = dataset_id(url)
        report = _Reporter(self.ctx.kube, self.ctx.node, ds_id, url)
        schedule = (spec.get("warmup") or {}).get("schedule")
        note = schedule_problem(schedule) if schedule else ""
        try:
            options = await self._storage_options(str(meta.get("namespace", "default")), spec)
            engine = self.ctx.engine or get_engine(self.ctx.config)
            # (while the dataset is listed, its first time on this node or again on schedule, the annotation says so
            # with the files found so far: the status shows Listing, not a dataset of no size)
            listing = asyncio.ensure_future(report.listing(engine.config.cache.dir))
            try:
                if refresh:
                    self._listed_at[uid] = self.clock()
                    log.info("warm-up of %s: listing the source again (warmup.schedule %s)", url, schedule)
                    await engine.refresh(url, storage_options=options)
                ds = await engine.open_dataset(url, storage_options=options)
            finally:
                listing.cancel()
            only = self._share(engine, ds)
            include = (spec.get("warmup") or {}).get("include") or spec.get("include")
            log.info("warming %s on this node (%s)", url, "its share of the group" if only else "whole")
            prog = await warm(engine, ds, include=include, exclude=spec.get("exclude"), only=only,
                              on_progress=report.progress)
            self._warmed[uid] = ds.version
            self._listed_at.setdefault(uid, self.clock())
            await report.send(prog, "done" if not prog.failed else "failed",
                              f"{len(prog.failed)} file(s) failed" if prog.failed else note, force=True)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await report.clear()
            raise
        except Exception as exc:
            log.warning("warm-up of %s: %s", url, exc)
            await report.send(report.last or Progress(), "failed", str(exc)[:500], force=True)
            raise

    def _pin(self, objs: list[Mapping[str, Any]], node: Mapping[str, Any]) -> None:
        """The datasets placed on this node with ``spec.pin`` are the ones eviction passes over here (the source
        ``cachedatasets`` of the index's pins: a pin whose object is gone, changed or placed elsewhere goes too)."""
        from cachefs.engine import get_engine
        from cachefs.index.hints import HintStore

        pins = {dataset_id(str(spec["url"])) for obj in objs if (spec := obj.get("spec") or {}).get("pin")
                and spec.get("url") and placed_on(spec, node)}
        engine = self.ctx.engine or get_engine(self.ctx.config)
        HintStore(engine.index).set_pins(PIN_SOURCE, pins)

    def _share(self, engine, ds):
        """This member's share of a group's dataset (None: the whole of it, outside a group)."""
        table = self.ctx.table
        if table is None or not self.ctx.group:
            return None
        windows, me, ds_id = DirectoryWindows(), self.ctx.node, ds.ref.id

        def mine(e) -> bool:
            key = (windows.key(ds, e.path) if engine.strategy(e) is engine.packs else
                   block_key(object_key(ds_id, e.path, e.version), 0))
            return table.placement.owner(key) in (me, None)

        return mine

    async def _storage_options(self, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if spec.get("endpointUrl"):
            options["endpoint_url"] = spec["endpointUrl"]
        if spec.get("region"):
            options["client_kwargs"] = {"region_name": spec["region"]}
        name = spec.get("credentialsSecret")
        if name:
            env = secret_credentials(await self.ctx.kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}"))
            options["key"], options["secret"] = env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
            if "AWS_SESSION_TOKEN" in env:
                options["token"] = env["AWS_SESSION_TOKEN"]
        return options


def schedule_problem(schedule: str) -> str:
    """Why ``warmup.schedule`` cannot be used ("" if it can): a five-field cron expression, in UTC."""
    if not isinstance(schedule, str) or len(schedule.split()) != 5 or not croniter.is_valid(schedule):
        return f"warmup.schedule {str(schedule)[:64]!r} is not a cron expression of five fields: not scheduled"
    return ""


def next_run(schedule: str, since: float) -> float:
    """The first time ``schedule`` (cron, UTC) names after ``since`` (epoch seconds)."""
    return float(croniter(schedule, datetime.fromtimestamp(since, tz=UTC)).get_next(float))


class _Reporter:
    """This node's progress annotation of one warm-up, patched at most every :data:`REPORT_EVERY` seconds."""

    def __init__(self, kube, node: str, ds_id: str, url: str) -> None:
        self.kube, self.node, self.key, self.url = kube, node, warm_key(ds_id), url
        self.last: Progress | None = None
        self._sent_at = 0.0
        self._pending: asyncio.Task | None = None
        WARMUP_RUNNING.labels(url).set(1)

    def progress(self, prog: Progress) -> None:
        self.last = prog
        self.measure(prog)
        if time.monotonic() - self._sent_at >= REPORT_EVERY and (self._pending is None or self._pending.done()):
            self._pending = asyncio.ensure_future(self.send(prog, "running", ""))

    async def listing(self, cache_dir: str) -> None:
        """Until cancelled: while this node lists the dataset, say so (``state`` listing, ``filesListed``) every
        :data:`REPORT_EVERY` seconds."""
        from cachefs.index.listings import listings_under_way

        while True:
            found = [li for li in await asyncio.to_thread(listings_under_way, cache_dir) if li["url"] == self.url]
            if found:
                await self.send(Progress(), "listing", "", listed=found[0]["files"])
            await asyncio.sleep(REPORT_EVERY)

    def measure(self, prog: Progress, running: bool = True) -> None:
        """The warm-up's metrics (cachefs_warmup_*), from the same figures as its annotation."""
        for state, files, nbytes in (("wanted", prog.files_total, prog.bytes_total),
                                     ("done", prog.files_done, prog.bytes_done)):
            WARMUP_FILES.labels(self.url, state).set(files)
            WARMUP_BYTES.labels(self.url, state).set(nbytes)
        WARMUP_FILES.labels(self.url, "failed").set(len(prog.failed))
        WARMUP_RUNNING.labels(self.url).set(1 if running else 0)

    async def send(self, prog: Progress, state: str, reason: str, *, force: bool = False, listed: int = 0) -> None:
        self._sent_at = time.monotonic()
        self.measure(prog, running=state in ("running", "listing"))
        value = json.dumps({"state": state, "filesDone": prog.files_done, "filesTotal": prog.files_total,
                            "bytesDone": prog.bytes_done, "bytesTotal": prog.bytes_total,
                            "errors": len(prog.failed), "reason": reason, **({"filesListed": listed} if listed else {})},
                           separators=(",", ":"), sort_keys=True)
        try:
            await self.kube.merge_patch(f"/api/v1/nodes/{self.node}", {"metadata": {"annotations": {self.key: value}}})
        except Exception as exc:  # noqa: BLE001 - progress is best effort; the next report says it again
            if force:
                log.warning("warm-up progress not published: %s", exc)

    async def clear(self) -> None:
        WARMUP_RUNNING.labels(self.url).set(0)
        await self.kube.merge_patch(f"/api/v1/nodes/{self.node}", {"metadata": {"annotations": {self.key: None}}})


async def warm_datasets(ctx) -> None:
    """This node's CacheDataset warm-ups (``ctx``: :class:`~cachefs.agent.node_agent.AgentContext`; nothing
    without a Kubernetes API)."""
    if ctx.kube is None:
        return
    await Warmups(ctx).run()

"""``cachefs agent``: the one long-running cachefs process of a node pod.

It runs the peer server (what this node serves its cache group), follows the group's membership (static, or
the EndpointSlices of the group's headless Service), writes it where the node's other cachefs processes read it
(:mod:`cachefs.cluster.members_file`), serves ``/healthz`` and ``/readyz`` beside the peer protocol and, with
``--metrics-listen``, the node's metrics. Tasks of other packages join through the ``cachefs.agent_tasks`` entry
point: scheduler_hints registers the label publisher, which runs on nodes outside every group too. FUSE sessions
stay with the mounter; they read through the group on their own, from the members file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from cachefs.agent.cache_lock import CacheDirLock
from cachefs.agent.peer_listener import PeerListener, raise_fd_limit
from cachefs.agent.peer_server import make_peer_app
from cachefs.agent.replicas import ReplicaStore
from cachefs.agent.serving import GroupServing
from cachefs.base.aio import stop_on_signals
from cachefs.base.config import ClusterConfig, Config, parse_listen, resolve_size
from cachefs.base.errors import ConfigError
from cachefs.base.log_limits import limit_logs
from cachefs.base.values import parse_size
from cachefs.cluster.auth import SharedSecret, TokenReviewer, check_credentials
from cachefs.cluster.heat import HeatTracker, hot_bytes_per_s
from cachefs.cluster.members_file import REWRITE_EVERY, MembersRecord, members_path, placement_path, write_members
from cachefs.cluster.membership import GROUP_LABEL, EndpointSliceWatch, MemberTable, parse_peers
from cachefs.cluster.tls import GroupTLS
from cachefs.engine import Engine, get_engine
from cachefs.status.summary import write_heat

if TYPE_CHECKING:
    from cachefs.kube import KubeClient

__all__ = ["AgentContext", "run_agent"]

log = logging.getLogger(__name__)


@dataclass
class AgentContext:
    """What an agent task gets: the config, this node's name and group ("" outside every group), the engine and
    the member table (None outside every group), a Kubernetes client (None without the API), and what the group's
    members hold per dataset, as their Node annotations say ({node: {dataset id: (cached, total)}}; None without
    the API)."""

    config: Config
    node: str
    group: str
    engine: Engine | None
    table: MemberTable | None
    kube: object | None
    group_datasets: Callable[[], dict[str, dict[str, tuple[int, int]]]] | None = None


def node_name(config: Config) -> str:
    return config.cluster.node_name or os.environ.get("NODE_NAME") or socket.gethostname()


def advertised(config: Config) -> str:
    k = config.cluster
    if k.advertise:
        return k.advertise
    host, port = parse_listen(k.listen, "cluster.listen")
    ip = os.environ.get("POD_IP") or (host if host not in ("0.0.0.0", "::") else "127.0.0.1")
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def run_agent(config: Config, *, kubeconfig: str | None = None, metrics_listen: str | None = None,
                    ready_file: str | None = None) -> int:
    """Run until SIGTERM/SIGINT."""
    k = config.cluster
    token_named = k.token_file != ClusterConfig().token_file
    if k.secret_file or token_named:  # named on the command line or in the config: wrong at once is wrong
        check_credentials(k.secret_file, k.token_file, token_named=token_named)
    node = node_name(config)
    # One agent per cache directory (a second one would fight the first), handed from a node pod to the next.
    lock = CacheDirLock(config.cache.dir, f"pid {os.getpid()}, node {node}, listening on {config.cluster.listen}")
    if not lock.try_take() and not await lock.wait():
        return 0  # (signalled while waiting)
    while True:
        handed_over = lock.watch_for_successor()
        try:
            rc = await _run_agent(config, node, kubeconfig=kubeconfig, metrics_listen=metrics_listen,
                                  ready_file=ready_file, token_named=token_named)
        finally:
            lock.release()
        if not handed_over.is_set():
            return rc
        log.warning("handed cache directory %s to the next node pod's agent; standing by", config.cache.dir)
        if not await lock.stand_by():
            return 0


async def _run_agent(config: Config, node: str, *, kubeconfig: str | None, metrics_listen: str | None,
                     ready_file: str | None, token_named: bool) -> int:
    k = config.cluster
    kube = None
    if not k.peers or not k.secret_file:
        from cachefs.kube import KubeClient, load_kube_config

        kube = KubeClient(load_kube_config(kubeconfig))
    group = k.group or (await _group_of_node(kube, node) if kube is not None else "")
    if not group:
        if k.peers:
            raise ConfigError("cachefs agent: no cache group (cluster.group, --group, CACHEFS_CLUSTER_GROUP)")
        group = await _outside_groups(config, node, kube)
        if not group:  # (signalled)
            if kube is not None:
                await kube.aclose()
            return 0
    config = dataclasses.replace(config, cluster=dataclasses.replace(k, group=group))
    k = config.cluster
    check_credentials(k.secret_file, k.token_file, token_named=token_named)  # (in a group, the default token too)
    engine = get_engine(config)
    engine.fetch_for_group()
    await engine.start_background()
    table = MemberTable(node, grace=k.drain_grace)
    tasks: list[asyncio.Task] = []
    synced, group_datasets, watching = _membership(config, node, table, kube)
    if watching is not None:
        tasks.append(watching)
    heat = HeatTracker(hot_requests=k.hot_requests_per_s, hot_bytes=hot_bytes_per_s(k), replicas=k.hot_replicas)
    listener = await _peer_listener(config, engine, table, synced, heat, kube)
    if metrics_listen:
        from cachefs.status.server import serve_metrics

        serve_metrics(config, *parse_listen(metrics_listen, "--metrics-listen"))
    tasks += _start_tasks(AgentContext(config, node, k.group, engine, table, kube, group_datasets))
    view = lambda: MembersRecord(k.group, node, table.members, frozenset(table.draining()),
                             k.token_file if not k.secret_file else "", k.secret_file,
                             tls=(k.tls_cert, k.tls_key, k.tls_ca))
    # The agent's own engine follows the file at once (its stats loop re-reads it only every few seconds, and
    # until then the engine fetched from the origin without asking the members that hold copies).
    tasks.append(asyncio.ensure_future(_keep_members_file(config.cache.dir, table, synced, view,
                                                          engine.group.refresh)))
    tasks.append(asyncio.ensure_future(_keep_heat_file(config.cache.dir, heat)))
    stop = stop_on_signals()
    log.info("cachefs agent %s of group %s: peer server on %s", node, k.group, k.listen)
    if ready_file:
        await synced.wait()
        with open(ready_file, "w") as f:
            f.write(advertised(config))
    try:
        await stop.wait()
    finally:
        await _cancel(tasks)
        with contextlib.suppress(OSError):  # readers stop asking a group this node no longer serves
            os.unlink(members_path(config.cache.dir))
        await listener.close()
        if kube is not None:
            await kube.aclose()
        await engine.aclose()
    return 0


def _membership(config: Config, node: str, table: MemberTable, kube: KubeClient | None
                ) -> tuple[asyncio.Event, Callable[[], dict] | None, asyncio.Task | None]:
    """Fill ``table`` with the group's members: from ``cluster.peers`` once, or from the peer Service's
    EndpointSlices (a watch task). (set once the members are known, the group's datasets or None, the task)."""
    k = config.cluster
    if k.peers:
        try:
            table.update(parse_peers(k.peers))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if node not in table.members:
            raise ConfigError(f"cluster.peers names no member {node!r} (this node: cluster.node_name, NODE_NAME)")
        synced = asyncio.Event()
        synced.set()
        return synced, None, None
    ns, _, svc = k.service.partition("/")
    assert kube is not None  # (made by the caller: no static member list)
    watch = EndpointSliceWatch(kube, ns, svc, table, group=k.group)
    return watch.synced, watch.group_datasets, asyncio.ensure_future(watch.run())


async def _peer_listener(config: Config, engine: Engine, table: MemberTable, synced: asyncio.Event,
                         heat: HeatTracker, kube: KubeClient | None) -> PeerListener:
    """The peer server, listening: who may ask (a shared secret or TokenReview), TLS, the replicas it keeps."""
    k = config.cluster
    if k.secret_file:
        verifier: SharedSecret | TokenReviewer = SharedSecret(k.secret_file)
    else:
        assert kube is not None  # (made by the caller: no shared secret)
        verifier = TokenReviewer(kube)
    tls = GroupTLS.of(k.tls_cert, k.tls_key, k.tls_ca)
    st = os.statvfs(config.cache.dir)
    replicas = ReplicaStore(config.cache.dir, resolve_size(config.checkpoint.staging_limit, st.f_blocks * st.f_frsize,
                                                           "checkpoint.staging_limit"))
    app = make_peer_app(GroupServing(engine, k.serve), table, verifier, weight=float(engine.capacity),
                        ready=synced.is_set, heat=heat, tls=tls is not None,
                        max_manifest=parse_size(k.max_manifest_push), replicas=replicas)
    host, port = parse_listen(k.listen, "cluster.listen")
    limit_logs()
    raise_fd_limit()
    listener = PeerListener(app, host, port, max_per_client=k.max_client_connections, idle_timeout=k.idle_timeout,
                            ssl_context=tls.server() if tls is not None else None)
    try:
        await listener.start()
    except OSError as exc:
        raise ConfigError(f"cluster.listen {k.listen}: {exc.strerror}") from None
    return listener


def _start_tasks(ctx: AgentContext) -> list[asyncio.Task]:
    """The tasks other packages register under the ``cachefs.agent_tasks`` entry point (the label publisher)."""
    tasks = []
    for ep in entry_points(group="cachefs.agent_tasks"):
        task_fn: Callable[[AgentContext], Awaitable[None]] = ep.load()
        tasks.append(asyncio.ensure_future(task_fn(ctx)))
    return tasks


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


#: How often an agent outside every cache group looks for its Node's group label (README labels nodes after
#: deploying; the agent then joins without a restart).
GROUP_LABEL_POLL = 10.0


async def _outside_groups(config: Config, node: str, kube) -> str:
    """A node outside every cache group: it reads through no group and serves none, but still publishes its labels
    and answers ``/healthz`` and ``/readyz`` on the peer port (the node pod's readiness probe). Returns the group once
    the Node is labelled with one, or "" when signalled."""
    log.info("node %s carries no %s label: it reads through no group and serves none", node, GROUP_LABEL)
    from aiohttp import web

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok (in no cache group)")

    app = web.Application()
    app.router.add_get("/healthz", ok)
    app.router.add_get("/readyz", ok)
    k = config.cluster
    listener = PeerListener(app, *parse_listen(k.listen, "cluster.listen"), max_per_client=k.max_client_connections,
                            idle_timeout=k.idle_timeout)
    try:
        await listener.start()
    except OSError as exc:
        raise ConfigError(f"cluster.listen {k.listen}: {exc.strerror}") from None
    publisher = _start_tasks(AgentContext(config, node, "", None, None, kube))  # (the label publisher)
    stop = stop_on_signals()
    group = ""
    try:
        while kube is not None and not group:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), GROUP_LABEL_POLL)
            if stop.is_set():
                break
            with contextlib.suppress(ConfigError):  # (the API unreachable for a while: ask again later)
                group = await _group_of_node(kube, node)
        if kube is None:
            await stop.wait()
    finally:
        await _cancel(publisher)
        await listener.close()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    if group:
        log.info("node %s is now labelled %s=%s: joining the group", node, GROUP_LABEL, group)
    return group


async def _group_of_node(kube, node: str) -> str:
    """The cache group of this node: its Node's ``cachefs.io/cache-group`` label ("" if none)."""
    from cachefs.kube import ApiError

    try:
        doc = await kube.get(f"/api/v1/nodes/{node}")
    except ApiError as exc:
        raise ConfigError(f"cachefs agent: cannot read Node {node} for its {GROUP_LABEL} label: {exc}") from None
    return str(((doc.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL, ""))


async def _keep_members_file(cache_dir: str, table: MemberTable, synced: asyncio.Event,
                             view: Callable[[], MembersRecord], on_written: Callable[[], object]) -> None:
    """Write the members file at every membership change and every REWRITE_EVERY seconds (its age tells readers
    that the agent is alive); ``on_written()`` after each write of a change."""
    await synced.wait()
    written, since = -1, 0.0
    loop = asyncio.get_running_loop()
    while True:
        table.expire()
        if table.generation != written or loop.time() - since >= REWRITE_EVERY:
            try:
                if table.generation != written:  # (the table first: a reader that sees the members finds it)
                    await asyncio.to_thread(table.placement.save, placement_path(cache_dir))
                await asyncio.to_thread(write_members, cache_dir, view())
                changed, written, since = table.generation != written, table.generation, loop.time()
                if changed:
                    on_written()
            except OSError as exc:
                log.warning("cache group: cannot write %s: %s", members_path(cache_dir), exc)
        await asyncio.sleep(0.5)


async def _keep_heat_file(cache_dir: str, heat: HeatTracker, every: float = 2.0) -> None:
    """Write what this member served and its hot directories where ``cachefs status`` and the node's metrics
    read them (:func:`cachefs.status.summary.write_heat`): within ``every`` seconds of a change, and every REWRITE_EVERY
    seconds while nothing changes (its age tells readers of the file that the agent is alive)."""
    loop = asyncio.get_running_loop()
    written, since = None, 0.0
    while True:
        doc = (heat.served_requests, heat.served_bytes, [k.to_json() for k in heat.hot()])
        if doc != written or loop.time() - since >= REWRITE_EVERY:
            try:
                await asyncio.to_thread(write_heat, cache_dir, *doc)
                written, since = doc, loop.time()
            except OSError as exc:
                log.warning("cache group: cannot write what this member served: %s", exc)
        await asyncio.sleep(every)

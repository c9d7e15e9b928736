"""Extender latency with 5,000 nodes: filter + prioritize round trips over HTTP, p50/p99, in both
``nodeCacheCapable`` modes, against kube-scheduler's 5 s extender timeout and our 50 ms target. The extender
runs in its own process, as deployed. Three figures per mode: the round trip as kube-scheduler sees it (sending
the request and reading the reply, from a minimal blocking HTTP client: aiohttp's client alone added ~13 ms per
15 MB round trip here, which kube-scheduler's Go client does not pay), and the time inside the extender
(request handed to the handler until its reply is ready, measured in the extender's process), and the same-run
baseline: the same requests and the extender's own replies through an aiohttp server that computes nothing.

    python -m bench.extender_bench [--nodes 5000] [--rounds 100]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from aiohttp import web

from bench.placement_dra import gpu_slice
from cachefs.base.types import dataset_id
from scheduler_hints.dra import DraInventory
from scheduler_hints.extender import Extender
from scheduler_hints.extender_http import make_app, tune_gc
from scheduler_hints.labels import dataset_key


def make_nodes(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    ds = [dataset_id(f"s3://bucket/ds{i}") for i in range(20)]
    nodes = []
    for i in range(n):
        labels = {"kubernetes.io/hostname": f"node-{i}", "nvidia.com/gpu.clique": f"c{i // 18}",
                  "network.topology.nvidia.com/block": f"leaf-{i // 64}", "topology.kubernetes.io/rack": f"r{i // 16}",
                  "cachefs.io/cache-group": f"r{i // 16}"}
        ann = {}
        for d in rng.sample(ds, 3):
            c = rng.randint(0, 1000)
            labels[dataset_key(d)] = str(c // 50 * 5)
            ann[dataset_key(d)] = json.dumps({"url": "s3://x", "cachedBytes": c, "totalBytes": 1000,
                                              "manifestVersion": 1, "updatedAt": "2026-11-29T00:00:00Z"})
        nodes.append({"metadata": {"name": f"node-{i}", "resourceVersion": str(1000 + i), "labels": labels,
                                   "annotations": ann},
                      "status": {"allocatable": {"cpu": "128", "memory": "2Ti", "nvidia.com/gpu": "8"}}})
    return nodes


POD = {"metadata": {"name": "trainer", "namespace": "ml", "uid": "u1",
                    "annotations": {"cachefs.io/datasets": "s3://bucket/ds3,s3://bucket/ds7"}},
       "spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}
#: The first member of a 16-pod gang: prioritize also scores every topology domain by its data.
GANG_POD = {"metadata": {"name": "gang-member", "namespace": "ml", "uid": "u2",
                         "annotations": {"cachefs.io/datasets": "s3://bucket/ds3", "cachefs.io/gang": "g",
                                         "cachefs.io/gang-size": "16"}},
            "spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}


def dra_world(nodes: list[dict]) -> tuple[list[dict], list[dict]]:
    """The same cluster with its GPUs published by a DRA driver: the nodes without ``nvidia.com/gpu`` and without
    the clique label, and a ResourceSlice per node whose 8 devices carry the clique."""
    bare, slices = [], []
    for n in nodes:
        labels = dict(n["metadata"]["labels"])
        clique = labels.pop("nvidia.com/gpu.clique")
        alloc = {k: v for k, v in n["status"]["allocatable"].items() if k != "nvidia.com/gpu"}
        bare.append({"metadata": {**n["metadata"], "labels": labels}, "status": {"allocatable": alloc}})
        slices.append(gpu_slice(n["metadata"]["name"], clique))
    return bare, slices


TEMPLATE = {"metadata": {"name": "eight-gpus", "namespace": "ml"}, "spec": {"spec": {"devices": {"requests": [
    {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 8}}]}}}}


def dra_pod(pod: dict) -> dict:
    """``pod`` asking for its GPUs through a claim made from :data:`TEMPLATE`."""
    return {**pod, "spec": {"containers": [{"name": "t", "resources": {"claims": [{"name": "gpus"}]}}],
                            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}]}}


def _serve(nodes: list[dict], churn: str, dra: bool, port_out) -> None:
    """The extender in its own process, as deployed (the client must not share its event loop and GIL).
    ``churn``: what changes before every request — "" nothing, "label" one node's labels, "bind" one more pod
    bound by the extender (and, past 500, the oldest one gone), "claim" one more claim's devices allocated (past
    500, the oldest claim deleted). ``dra``: the GPUs come from ResourceSlices (:func:`dra_world`)."""

    async def main() -> None:
        ext = Extender(dra=DraInventory()) if dra else Extender()
        cluster = nodes
        if dra:
            assert ext.dra is not None
            cluster, slices = dra_world(nodes)
            for sl in slices:
                ext.dra.on_slice("ADDED", sl)
            ext.dra.on_template("ADDED", TEMPLATE)
        for n in cluster:
            ext.node_cache.update(n)
        ext.node_cache.dra_changed()
        claims: list[dict] = []
        if churn:
            filter_, count = ext.filter, iter(range(10**9))

            def churning_filter(body):
                i = next(count)
                n = nodes[i * 37 % len(nodes)]
                if churn == "label":  # a node agent publishes new figures (5,000 agents do so every few ms)
                    meta = dict(n["metadata"], resourceVersion=f"churn-{i}",
                                labels={**n["metadata"]["labels"], "cachefs.io/free-gib": str(i)})
                    ext.node_cache.update({**n, "metadata": meta})
                elif churn == "claim":  # kube-scheduler's DRA plugin allocated one more pod's devices
                    assert ext.dra is not None
                    name = n["metadata"]["name"]
                    claim = {"metadata": {"name": f"c-{i}", "namespace": "ml"}, "status": {"allocation": {
                        "devices": {"results": [{"request": "gpus", "driver": "gpu.nvidia.com", "pool": name,
                                                 "device": f"gpu-{i % 8}"}]}}}}
                    ext.dra.on_claim("ADDED", claim)
                    claims.append(claim)
                    if len(claims) > 500:
                        ext.dra.on_claim("DELETED", claims.pop(0))
                else:  # the extender bound the previous pod: its GPUs are held on that node
                    ext.bound_pods[f"ml/bound-{i}"] = (n["metadata"]["name"], 1)
                    if len(ext.bound_pods) > 500:
                        ext.pod_gone(next(iter(ext.bound_pods)))
                return filter_(body)

            ext.filter = churning_filter
        tune_gc()  # as `cachefs scheduler-extender` does once its caches are loaded
        inside: list[float] = []

        @web.middleware
        async def timed(request, handler):
            t = time.perf_counter()
            try:
                return await handler(request)
            finally:
                inside.append(time.perf_counter() - t)

        async def report(_request):
            port_out.send(inside[:])
            inside.clear()
            return web.Response(text="ok")

        app = make_app(ext)
        app.middlewares.append(timed)
        app.router.add_get("/bench-times", report)
        await _serve_app(app, port_out)

    asyncio.run(main())


def _serve_fixed(replies: dict[str, bytes], port_out) -> None:
    """The same-run baseline: an aiohttp server that reads each request and answers the extender's own reply
    bytes, computing nothing — what the same bytes cost on the wire and in aiohttp."""

    async def main() -> None:
        async def handle(request):
            await request.read()
            return web.Response(body=replies[request.match_info["verb"]], content_type="application/json")

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/{verb}", handle)
        await _serve_app(app, port_out)

    asyncio.run(main())


async def _serve_app(app: web.Application, port_out) -> None:
    """Serve ``app`` on a loopback port, send the port through ``port_out``, and serve until killed."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_out.send(site._server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()


def pod_bodies(pod: dict, rest: dict) -> Callable[[int], bytes]:
    """Request ``i``: ``pod`` as the ``i``-th pod of its job (its own name and uid; kube-scheduler sends the pods
    of a job one after another) with the same ``rest`` (the node list) every time."""
    tail = json.dumps(rest).encode()[1:]  # past the opening brace

    def body(i: int) -> bytes:
        meta = dict(pod["metadata"], name=f"{pod['metadata']['name']}-{i}", uid=f"{pod['metadata']['uid']}-{i}")
        return json.dumps({"Pod": {**pod, "metadata": meta}}).encode()[:-1] + b", " + tail

    return body


def measure(port: int, bodies: Callable[[int], bytes], rounds: int) -> tuple[list[float], dict[str, bytes]]:
    """Round trips of filter then prioritize for one pod after another (``bodies(i)``, made before the clock
    starts) on one kept-alive connection, in ms, and the last replies."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    times, replies = [], {}
    for i in range(rounds):
        body = bodies(i)
        t = time.perf_counter()
        for verb in ("filter", "prioritize"):
            conn.request("POST", f"/{verb}", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            replies[verb] = r.read()
            assert r.status == 200, replies[verb][:200]
        times.append((time.perf_counter() - t) * 1000)
    conn.close()
    return times, replies


def _measure_extender(bodies: Callable[[int], bytes], rounds: int, port: int, pipe) -> tuple[list[float], dict[str, bytes], list]:
    """:func:`measure`, then the handler times the extender process recorded."""
    times, replies = measure(port, bodies, rounds)
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("GET", "/bench-times")
    conn.getresponse().read()
    return times, replies, pipe.recv()


def _in_process(target, args: tuple, work):
    """Run ``target(*args, port_pipe)`` in its own process and ``work(port, pipe)`` against it."""
    ours, theirs = multiprocessing.Pipe()
    server = multiprocessing.Process(target=target, args=(*args, theirs), daemon=True)
    server.start()
    try:
        return work(ours.recv(), ours)
    finally:
        server.kill()
        server.join()


def percentiles(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times), times[math.ceil(len(times) * 0.99) - 1]  # p99: nearest rank


def run(nodes: list[dict], rounds: int) -> None:
    names = [n["metadata"]["name"] for n in nodes]
    full = pod_bodies(POD, {"Nodes": {"items": nodes}})
    by_name = pod_bodies(POD, {"NodeNames": names})
    gang = pod_bodies(GANG_POD, {"NodeNames": names})
    dra_single = pod_bodies(dra_pod(POD), {"NodeNames": names})
    dra_gang = pod_bodies(dra_pod(GANG_POD), {"NodeNames": names})
    for label, body, churn, dra in (
            ("nodeCacheCapable=false (full Node objects)", full, "", False),
            ("the same with one more pod bound by the extender before every request", full, "bind", False),
            ("nodeCacheCapable=true (names)", by_name, "", False),
            ("nodeCacheCapable=true, first member of a 16-pod gang (nothing changes between "
             "requests: the kept answer)", gang, "", False),
            ("the same with one node re-labelled before every request (the gang's topology "
             "scored afresh)", gang, "label", False),
            ("DRA: a ResourceSlice for every node (cliques only in device attributes), names, a pod claiming 8 "
             "GPUs, one more claim allocated before every request", dra_single, "claim", True),
            ("DRA: the same for the first member of a 16-pod gang claiming its GPUs", dra_gang, "claim", True)):
        times, replies, handler = _in_process(_serve, (nodes, churn, dra), partial(_measure_extender, body, rounds))
        wire_only, _ = _in_process(_serve_fixed, (replies,), lambda port, _pipe, b=body: measure(port, b, rounds))
        size = len(body(0))
        first = times[0]  # pays for scoring every node; later calls reuse it
        inside = [(a + b) * 1000 for a, b in zip(handler[0::2], handler[1::2], strict=True)]
        p50, p99 = percentiles(times)
        i50, i99 = percentiles(inside)
        w50, w99 = percentiles(wire_only)
        print(f"{len(nodes)} nodes, {label}: filter+prioritize round trip p50 {p50:.1f} ms, p99 {p99:.1f} ms "
              f"(request {size / 1e6:.1f} MB) → p99 vs 50 ms target {p99 / 50:.2f}×, vs 5 s timeout "
              f"{p99 / 5000:.3f}×; inside the extender p50 {i50:.1f} ms, p99 {i99:.1f} ms ({i99 / 50:.2f}×); "
              f"first call {first:.1f} ms, slowest {max(times):.1f} ms; the same bytes through a server that "
              f"computes nothing: p50 {w50:.1f} ms, p99 {w99:.1f} ms (round-trip p50 {p50 / w50:.1f}× that)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=100)
    args = p.parse_args()
    run(make_nodes(args.nodes), args.rounds)


if __name__ == "__main__":
    main()

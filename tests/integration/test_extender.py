"""The extender over real HTTP (aiohttp on a loopback port), with payloads shaped exactly as kube-scheduler
sends them: ExtenderArgs with Go field names, Node and Pod objects in Kubernetes JSON."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from cachefs.base.types import dataset_id
from scheduler_hints.extender import Extender
from scheduler_hints.extender_http import MAX_BODY, make_app
from scheduler_hints.extender_wire import encode
from scheduler_hints.gang import GangManager
from scheduler_hints.labels import dataset_key
from scheduler_hints.pods import StaticVolumes, pod_gang

URL = "s3://bucket/imagenet"
DS = dataset_id(URL)


def node(name, *, fraction=None, gpus=8, clique=None, leaf=None):
    labels = {"kubernetes.io/hostname": name}
    ann = {}
    if fraction is not None:
        labels[dataset_key(DS)] = str(int(fraction * 100))
        ann[dataset_key(DS)] = json.dumps({"url": URL, "cachedBytes": int(fraction * 1000), "totalBytes": 1000,
                                           "manifestVersion": 1, "updatedAt": "2026-11-29T00:00:00Z"})
    if clique:
        labels["nvidia.com/gpu.clique"] = clique
    if leaf:
        labels["network.topology.nvidia.com/block"] = leaf
    return {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": labels, "annotations": ann},
            "status": {"allocatable": {"cpu": "64", "nvidia.com/gpu": str(gpus)}, "capacity": {"nvidia.com/gpu": str(gpus)}}}


def pod(name, *, claim=None, inline=None, annotation=None, gpus=0, gang=None, gang_size=None, uid=None):
    ann, labels, volumes = {}, {}, []
    if annotation:
        ann["cachefs.io/datasets"] = annotation
    if claim:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": claim}})
    if inline:
        volumes.append({"name": "inline", "csi": {"driver": "csi.cachefs.io", "volumeAttributes": {"url": inline}}})
    if gang:
        labels["scheduling.x-k8s.io/pod-group"] = gang
        ann["cachefs.io/gang-size"] = str(gang_size)
    res = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": "ml", "uid": uid or f"uid-{name}", "labels": labels,
                         "annotations": ann},
            "spec": {"containers": [{"name": "train", "image": "x", "resources": res}], "volumes": volumes}}


def args(p, nodes):
    return {"Pod": p, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None}


@pytest.fixture
def server():
    """Start the extender on a loopback port in its own loop thread; yield (base URL, extender, runner)."""
    import threading

    loop = asyncio.new_event_loop()
    ext = Extender(volumes=StaticVolumes({("ml", "imagenet-pvc"): URL}),
                   gangs=GangManager(bind_timeout=2.0))
    started = threading.Event()
    box = {}

    async def start():
        runner = web.AppRunner(make_app(ext))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"] = runner
        box["port"] = site._server.sockets[0].getsockname()[1]
        started.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    t.start()
    started.wait(10)
    yield f"http://127.0.0.1:{box['port']}", ext
    asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)
    loop.close()


def post(base, verb, body, raw=None):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{base}/{verb}", data=raw if raw is not None else json.dumps(body)) as r:
                return r.status, await r.json()

    return asyncio.run(go())


def test_prioritize_prefers_the_node_holding_the_data(server):
    base, _ = server
    nodes = [node("a", fraction=0.9), node("b", fraction=0.1), node("c")]
    for p in (pod("p1", claim="imagenet-pvc"), pod("p2", inline=URL), pod("p3", annotation=f"{URL}, s3://x/y")):
        status, scores = post(base, "prioritize", args(p, nodes))
        assert status == 200
        by = {s["Host"]: s["Score"] for s in scores}
        assert by["a"] > by["b"] > by["c"] == 0, by
        assert all(0 <= s["Score"] <= 10 and set(s) == {"Host", "Score"} for s in scores)


def test_pod_without_data_or_gpus_gets_neutral_scores(server):
    base, _ = server
    status, scores = post(base, "prioritize", args(pod("plain"), [node("a", fraction=1.0), node("b")]))
    assert status == 200 and {s["Score"] for s in scores} == {0}


def test_filter_passes_everything_for_ordinary_pods_and_accepts_any_case(server):
    base, _ = server
    body = {"pod": pod("p", annotation=URL), "nodes": {"items": [node("a"), node("b")]}}
    status, res = post(base, "filter", body)
    assert status == 200
    assert [n["metadata"]["name"] for n in res["Nodes"]["items"]] == ["a", "b"]
    assert res["FailedNodes"] == {} and res["Error"] == "" and "FailedAndUnresolvableNodes" in res


def test_node_cache_capable_mode_uses_names(server):
    base, ext = server
    for n in (node("a", fraction=1.0), node("b")):
        ext.node_cache.update(n)
    status, res = post(base, "filter", {"Pod": pod("p", annotation=URL), "NodeNames": ["a", "b"]})
    assert status == 200 and res["NodeNames"] == ["a", "b"] and res["Nodes"] is None
    status, scores = post(base, "prioritize", {"Pod": pod("p", annotation=URL), "NodeNames": ["a", "b"]})
    assert {s["Host"]: s["Score"] for s in scores} == {"a": 10, "b": 0}


@pytest.mark.parametrize(("verb", "raw", "status"), [
    ("filter", b"{not json", 400),
    ("filter", b"\xff\xfe{}", 400),
    ("filter", b'{"Pod": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),  # nested past any decoder's depth
    ("filter", b'{"Pod": {}, "Nodes": {"items": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}}", 400),
    ("filter", b"[]", 400),
    ("filter", b'{"Pod": {}, "Nodes": {"items": 7}}', 400),
    ("prioritize", b'{"Pod": {}}', 400),
    ("bind", b'{"PodName": 3}', 400),
    ("filter", b"", 400),
    ("prioritize", b"", 400),
    ("bind", b"", 400),
    ("preempt-everything", b"{}", 404),
])
def test_bad_requests_get_clear_4xx(server, verb, raw, status):
    base, _ = server
    got, body = post(base, verb, None, raw=raw)
    assert got == status and body["Error"]


def bind_request(base, p, node_name):
    body = {"PodName": p["metadata"]["name"], "PodNamespace": p["metadata"]["namespace"],
            "PodUID": p["metadata"]["uid"], "Node": node_name}
    return post(base, "bind", body)


def test_a_forged_bind_binds_nothing(server):
    """Only a pod our filter let through may be bound, only to a node it passed, and only once per filter:
    anything else is a 403 and no Binding is made."""
    base, ext = server
    nodes = [node("a"), node("b")]
    never_filtered = pod("victim", gpus=1)
    status, body = bind_request(base, never_filtered, "a")
    assert status == 403 and "filter" in body["Error"]
    refused_there = pod("refused", gpus=1)
    status, res = post(base, "filter", args(refused_there, nodes[1:]))  # kube-scheduler had ruled out a
    assert [n["metadata"]["name"] for n in res["Nodes"]["items"]] == ["b"]
    status, body = bind_request(base, refused_there, "a")
    assert status == 403, body
    assert ext.binder.bindings == []
    # the request a real kube-scheduler makes: filter, then bind to a node that passed
    ok = pod("ok", gpus=1)
    post(base, "filter", args(ok, nodes))
    assert bind_request(base, ok, "b") == (200, {"Error": ""})
    assert ext.binder.bindings == [("ml", "ok", "b")]
    status, body = bind_request(base, ok, "b")  # replayed
    assert status == 403
    impostor = dict(ok, metadata=dict(ok["metadata"], name="other"))
    post(base, "filter", args(ok, nodes))
    assert bind_request(base, impostor, "b")[0] == 403  # the uid of a held pod with another pod's name
    assert ext.binder.bindings == [("ml", "ok", "b")]


def test_pods_smaller_than_a_node_keep_whole_nodes_free_while_whole_node_pods_wait(server):
    """A 1-GPU pod prefers the whole free node that holds its data, until pods needing a whole node are
    pending and outnumber the whole free nodes: then it fills a partly used node instead."""
    base, ext = server
    nodes = [node("holder", fraction=1.0), node("busy")]
    ext.bound_pods["ml/running"] = ("busy", 7)  # one GPU left on "busy"
    small = pod("small", annotation=URL, gpus=1)

    def scores():
        status, body = post(base, "prioritize", args(small, nodes))
        assert status == 200
        return {s["Host"]: s["Score"] for s in body}

    calm = scores()
    assert calm["holder"] > calm["busy"]
    ext.pod_pending("uid-big-0", 8)  # one whole-node pod pending, one whole free node: not short yet
    assert scores() == calm
    ext.pod_pending("uid-big-1", 8)
    short = scores()
    assert short["busy"] > short["holder"]
    ext.pod_gone("uid-big-0")
    ext.pod_gone("uid-big-1")
    assert scores() == calm and not ext.pending_pods


def test_same_node_list_again_follows_node_cache_changes(server):
    """The same request bytes again reuse the decoded node list; a node-cache change in between (here the
    node leaving the watch's view) is still seen: the request's nodes are checked and scored again."""
    base, ext = server
    nodes = [node("holder", fraction=1.0), node("empty", fraction=0.0), node("bare")]
    body = json.dumps(args(pod("p", annotation=URL), nodes))
    first = post(base, "prioritize", None, raw=body)
    assert post(base, "prioritize", None, raw=body) == first
    ext.node_cache.remove("holder")
    assert "holder" not in ext.node_cache.nodes
    assert post(base, "prioritize", None, raw=body) == first
    assert "holder" in ext.node_cache.nodes  # the request's node is known again
    scores = {h["Host"]: h["Score"] for h in first[1]}
    assert scores["holder"] > scores["empty"]


def test_same_names_again_follow_node_cache_updates(server):
    """nodeCacheCapable: true, the same NodeNames bytes pod after pod: the extender keeps what it resolved them
    to, yet nodes the watch updates in between (data, GPUs) or removes are scored as they are now — as an
    extender that never saw the earlier requests scores them."""
    base, ext = server
    ext.node_cache.refresh_interval = 0  # the cluster view follows cache labels at once
    for n in (node("a", fraction=1.0), node("b", fraction=0.0), node("c")):
        ext.node_cache.update(n)
    names = ["a", "b", "c"]
    count = iter(range(100))

    def scores():
        body = {"Pod": pod(f"p{next(count)}", annotation=URL, gpus=8), "NodeNames": names}
        _, got = post(base, "prioritize", body)
        fresh = Extender(volumes=ext.volumes)
        for n in ext.node_cache.nodes.values():
            fresh.node_cache.update(n)
        want = {s["Host"]: s["Score"] for s in fresh.prioritize(body)}
        assert {s["Host"]: s["Score"] for s in got} == want
        return want

    first = scores()
    assert first["a"] > first["b"] > 0 and scores() == first
    ext.node_cache.update(node("b", fraction=1.0))
    ext.node_cache.update(node("a", gpus=0, fraction=1.0))  # a's GPUs are gone
    now = scores()
    assert now["b"] == first["a"] and now["a"] < first["a"], (first, now)
    ext.node_cache.remove("c")
    assert scores()["c"] == 0 and "c" in ext.node_cache.nodes  # known again, bare: no GPUs to offer
    for i in range(300):  # more changes than the extender patches: the names are looked up afresh
        ext.node_cache.update(node(f"n{i}"))
    ext.node_cache.update(node("c"))
    assert scores()["c"] == first["c"]


@pytest.mark.parametrize("by_name", [False, True], ids=["full-nodes", "names"])
def test_pod_after_pod_answers_match_a_fresh_extender_while_binds_and_nodes_change(server, by_name):
    """kube-scheduler asks pod after pod about the same nodes, and the extender keeps what did not change (the
    last scores, replies, candidates and held states). While pods are bound and leave, nodes change their data
    and GPUs, and whole-node pods queue, every filter and prioritize answer equals that of an extender that
    never saw the earlier requests."""
    base, ext = server
    ext.node_cache.refresh_interval = 0  # the cluster view follows cache labels at once
    ext.admission.clock = lambda: 0.0  # delay scheduling counts waits alike in both
    rng = random.Random(5)
    version = iter(range(1, 10**6))

    def fresh_node(name):  # a few nodes hold the data: binding pods there changes what delay scheduling sees
        holds = rng.choice([1.0, 0.7]) if int(name[1:]) < 2 else rng.choice([None, 0.0, 0.3])
        n = node(name, fraction=holds, gpus=rng.choice([8, 8, 4]), clique=f"c{int(name[1:]) % 4}")
        n["metadata"]["resourceVersion"] = str(next(version))
        return n

    nodes = {f"n{i}": fresh_node(f"n{i}") for i in range(30)}
    names = list(nodes)
    for n in [*nodes.values(), node("elsewhere", gpus=8, clique="c0")]:  # in the cluster, never a candidate
        ext.node_cache.update(n)
    refused = 0
    for step in range(80):
        op = rng.randrange(6)
        if op in (0, 5):  # mostly on the nodes holding the data, so that they fill up at times
            ext.bound_pods[f"ml/b{step}"] = (rng.choice([*names[:3], "elsewhere"]), rng.randint(2, 8))
        elif op == 1 and ext.bound_pods:
            ext.pod_gone(rng.choice(list(ext.bound_pods)))
        elif op == 2:
            name = rng.choice(names)
            nodes[name] = fresh_node(name)
            if by_name:  # the watch delivers it; with full nodes the next request carries it
                ext.node_cache.update(nodes[name])
        elif op == 3:
            for k in range(rng.randint(1, 12)):
                ext.pod_pending(f"ml/w{step}-{k}", 8)
        elif op == 4:
            for key in list(ext.pending_pods)[: rng.randint(1, 12)]:
                ext.pod_gone(key)
        member = rng.random() < 0.3  # a gang's first member, scored by topology over the whole cluster
        p = pod(f"p{step}", annotation=URL, gpus=rng.choice([1, 2, 4]), gang="g" if member else None, gang_size=3)
        body = {"Pod": p, "NodeNames": names} if by_name else {"Pod": p, "Nodes": {"items": list(nodes.values())}}
        raw = json.dumps(body)
        fresh = Extender(volumes=ext.volumes, clock=ext.admission.clock)
        fresh.node_cache.refresh_interval = 0
        for n in ext.node_cache.nodes.values():
            fresh.node_cache.update(n)
        fresh.bound_pods, fresh.pending_pods = dict(ext.bound_pods), dict(ext.pending_pods)
        for verb in ("prioritize",) if member else ("filter", "prioritize"):  # (filter would admit the gang)
            status, got = post(base, verb, None, raw=raw)
            want = json.loads(encode(getattr(fresh, verb)(json.loads(raw))))
            assert status == 200 and got == want, (step, verb)
            refused += verb == "filter" and bool(got["FailedNodes"])
    assert 0 < refused < 80  # delay scheduling both held pods back and let them run

def test_a_gangs_first_member_follows_gpus_held_on_nodes_that_are_not_candidates(server):
    """The first member's topology term counts free GPUs over the whole cluster: a pod bound on a node that is
    not among the candidates still changes the answer for the same request bytes."""
    base, ext = server
    for n in (node("a", fraction=1.0, clique="c0"), node("b", clique="c0"), node("elsewhere", clique="c0"),
              node("c", clique="c1"), node("d", clique="c1")):
        ext.node_cache.update(n)
    member = pod("m0", annotation=URL, gpus=8, gang="g", gang_size=3)
    raw = json.dumps({"Pod": member, "NodeNames": ["a", "b", "c", "d"]})

    def scores():
        fresh = Extender(volumes=ext.volumes)
        for n in ext.node_cache.nodes.values():
            fresh.node_cache.update(n)
        fresh.bound_pods = dict(ext.bound_pods)
        status, got = post(base, "prioritize", None, raw=raw)
        assert status == 200 and got == fresh.prioritize(json.loads(raw))
        return {s["Host"]: s["Score"] for s in got}

    before = scores()
    assert scores() == before  # asked again: the kept answer
    ext.bound_pods["ml/other"] = ("elsewhere", 8)  # clique c0 can no longer hold the whole gang
    after = scores()
    assert after != before and after["a"] < before["a"], (before, after)


def test_oversized_request_is_refused():
    import io

    from aiohttp.test_utils import TestClient, TestServer

    async def go():
        async with TestClient(TestServer(make_app(Extender(), max_body=1024))) as client:
            r = await client.post("/filter", data=io.BytesIO(b"x" * 4096))
            return r.status, (await r.json())["Error"]

    status, error = asyncio.run(go())
    assert status == 413 and "1024" in error
    assert 8 * 1024 * 1024 <= MAX_BODY < 50_000_000  # full Node objects of thousands of nodes; 50 MB refused

    async def with_length():  # a Content-Length over the cap is refused before the body is read
        async with TestClient(TestServer(make_app(Extender(), max_body=1024))) as client:
            r = await client.post("/filter", data=b"x" * 4096)
            return r.status, r.request_info.headers.get("Content-Length")

    assert asyncio.run(with_length()) == (413, "4096")


def test_body_cut_short_leaves_the_extender_serving(caplog):
    """A client that sends less than its Content-Length and hangs up gets nothing (it is gone), and the
    extender logs no handler error and answers the next request."""
    import logging
    import socket

    from aiohttp.test_utils import TestServer

    async def go():
        async with TestServer(make_app(Extender())) as srv:
            reader, writer = await asyncio.open_connection(srv.host, srv.port)
            writer.write(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"Pod\": {}")
            await writer.drain()
            writer.transport.get_extra_info("socket").shutdown(socket.SHUT_WR)
            await asyncio.wait_for(reader.read(), 10)
            writer.close()
            reader, writer = await asyncio.open_connection(srv.host, srv.port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return reply

    with caplog.at_level(logging.ERROR):
        reply = asyncio.run(go())
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok"), reply[:300]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_two_gangs_that_cannot_both_fit_never_deadlock(server):
    """6 free GPUs, two gangs of 4 × 1-GPU pods arriving together: one is admitted and bound whole, the other
    stays pending whole (holding nothing) and is admitted once the first is gone."""
    base, ext = server
    nodes = [node("n1", gpus=3), node("n2", gpus=3)]
    a = [pod(f"a{i}", gpus=1, gang="ga", gang_size=4) for i in range(4)]
    b = [pod(f"b{i}", gpus=1, gang="gb", gang_size=4) for i in range(4)]
    results = {}
    for pa, pb in zip(a, b, strict=True):  # interleaved, as a scheduler queue would hand them out
        results[pa["metadata"]["name"]] = post(base, "filter", args(pa, nodes))[1]
        results[pb["metadata"]["name"]] = post(base, "filter", args(pb, nodes))[1]
    assert all(results[f"a{i}"]["Nodes"]["items"] for i in range(4))
    assert all(not results[f"b{i}"]["Nodes"]["items"] and results[f"b{i}"]["FailedNodes"] for i in range(4))

    async def bind_all(pods, spread):
        async with aiohttp.ClientSession() as s:
            async def one(p, n):
                body = {"PodName": p["metadata"]["name"], "PodNamespace": "ml", "PodUID": p["metadata"]["uid"],
                        "Node": n}
                async with s.post(f"{base}/bind", data=json.dumps(body)) as r:
                    return (await r.json())["Error"]
            return await asyncio.gather(*(one(p, spread[i % len(spread)]) for i, p in enumerate(pods)))

    assert asyncio.run(bind_all(a, ["n1", "n2"])) == [""] * 4
    assert sorted(name for _, name, _ in ext.binder.bindings) == ["a0", "a1", "a2", "a3"]
    # gang b is still not admitted while a holds its GPUs
    assert not post(base, "filter", args(b[0], nodes))[1]["Nodes"]["items"]
    for p in a:
        ext.pod_gone(p["metadata"]["uid"])
    assert post(base, "filter", args(b[0], nodes))[1]["Nodes"]["items"]
    for p in b:
        post(base, "filter", args(p, nodes))
    assert asyncio.run(bind_all(b, ["n1", "n2"])) == [""] * 4


def test_incomplete_gang_binds_nothing(server):
    base, ext = server
    nodes = [node("n1", gpus=8)]
    members = [pod(f"g{i}", gpus=2, gang="g", gang_size=3) for i in range(2)]  # only 2 of 3 ever arrive
    for p in members:
        post(base, "filter", args(p, nodes))

    async def bind(p):
        async with aiohttp.ClientSession() as s:
            body = {"PodName": p["metadata"]["name"], "PodNamespace": "ml", "PodUID": p["metadata"]["uid"],
                    "Node": "n1"}
            async with s.post(f"{base}/bind", data=json.dumps(body)) as r:
                return (await r.json())["Error"]

    async def both():
        return await asyncio.gather(*(bind(p) for p in members))

    errors = asyncio.run(both())
    assert all("retried" in e for e in errors)
    assert ext.binder.bindings == []


def test_gang_members_prefer_the_clique_of_those_already_placed(server):
    base, _ = server
    nodes = [node("c1a", clique="c1", leaf="l1"), node("c1b", clique="c1", leaf="l1"),
             node("c2a", clique="c2", leaf="l1"), node("c3a", clique="c3", leaf="l2")]
    members = [pod(f"m{i}", gpus=8, gang="big", gang_size=3) for i in range(3)]
    post(base, "filter", args(members[0], nodes))

    async def bind_first():
        async with aiohttp.ClientSession() as s:
            body = {"PodName": "m0", "PodNamespace": "ml", "PodUID": "uid-m0", "Node": "c1a"}
            async with s.post(f"{base}/bind", data=json.dumps(body)) as r:
                return await r.json()

    async def scenario():
        task = asyncio.ensure_future(bind_first())  # waits for the rest of the gang
        await asyncio.sleep(0.3)
        return task

    loop = asyncio.new_event_loop()
    try:
        task = loop.run_until_complete(scenario())
        _, scores = post(base, "prioritize", args(members[1], nodes))
        by = {s["Host"]: s["Score"] for s in scores}
        assert by["c1b"] > by["c2a"] > by["c3a"], by
        loop.run_until_complete(asyncio.wait_for(task, 5))
    finally:
        loop.close()


def test_pod_waits_for_the_busy_node_holding_its_data_then_runs_elsewhere(server):
    """Delay scheduling: the only holder is full, so the pod is refused on the free node without data for up to
    ``locality_wait``; it passes at once when the holder frees up, or anywhere once the wait is over."""
    base, ext = server
    now = [1000.0]
    ext.admission.clock = lambda: now[0]
    nodes = [node("holder", fraction=1.0), node("empty")]
    for n in nodes:
        ext.node_cache.update(n)
    ext.bound_pods["ml/other"] = ("holder", 8)  # the holder's GPUs are taken
    p = pod("p", annotation=URL, gpus=8)
    _, out = post(base, "filter", args(p, [node("empty")]))  # kube-scheduler's candidates: only the free node
    assert out["Nodes"]["items"] == [] and "holding its data" in out["FailedNodes"]["empty"], out
    said = out["FailedNodes"]["empty"]
    assert "the free ones hold 0 percent" in said and "the best ones 100 percent" in said
    ext.pod_gone("ml/other")  # the holder frees up within the wait: the pod goes there
    _, out = post(base, "filter", args(p, nodes))
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["holder", "empty"] and not out["FailedNodes"]
    ext.bound_pods["ml/other"] = ("holder", 8)
    now[0] += ext.admission.locality_wait  # the wait is over: it runs where there is room
    _, out = post(base, "filter", args(p, [node("empty")]))
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["empty"]
    # a pod whose data no node holds, or a pod without data, never waits
    for q in (pod("q", annotation="s3://bucket/elsewhere", gpus=8), pod("r", gpus=8)):
        assert post(base, "filter", args(q, [node("empty")]))[1]["Nodes"]["items"]


def test_gang_waits_for_its_data_before_admission(server):
    """A gang that fits but whose data sits on busy nodes is not admitted (holds nothing) until the holders free
    up or the wait ends; then it is admitted as usual."""
    base, ext = server
    now = [0.0]
    ext.admission.clock = lambda: now[0]
    nodes = [node("h1", fraction=0.9), node("h2", fraction=0.9), node("e1"), node("e2")]
    for n in nodes:
        ext.node_cache.update(n)
    ext.bound_pods["ml/x"] = ("h1", 8)
    members = [pod(f"g{i}", annotation=URL, gpus=8, gang="g", gang_size=2) for i in range(2)]
    _, out = post(base, "filter", args(members[0], nodes[2:]))
    assert not out["Nodes"]["items"] and "gang ml/g (2 pods)" in out["FailedNodes"]["e1"], out
    assert not ext.gangs.admitted(pod_gang(members[0], {}))
    now[0] += ext.admission.locality_wait
    _, out = post(base, "filter", args(members[0], nodes[2:]))
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["e1", "e2"]


def test_pod_watch_tracks_pending_gpu_pods_until_they_are_bound_or_gone():
    from scheduler_hints.watch import ClusterWatch

    ext = Extender()
    watch = ClusterWatch(None, ext)  # the reflectors are not started: events are fed by hand
    big, cpu_only = pod("big", gpus=8), pod("cpu-only")
    watch._on_pod("ADDED", big)
    watch._on_pod("ADDED", cpu_only)
    assert ext.pending_pods == {"uid-big": 8}  # keyed by uid, as every pod record is
    watch._on_pod("MODIFIED", {**big, "spec": {**big["spec"], "nodeName": "n1"}})
    assert not ext.pending_pods and list(ext.bound_pods.values()) == [("n1", 8)]
    watch._on_pod("ADDED", pod("other", gpus=2))
    watch._on_pod("DELETED", pod("other", gpus=2))
    assert not ext.pending_pods


def test_the_next_pod_of_a_job_sees_the_gpus_taken_since_the_last(server):
    """Scores are kept for the pods of a job scored one after another; a node whose free GPUs changed in between
    is scored again (here it now fits a 4-GPU pod exactly)."""
    base, ext = server
    nodes = [node("a", fraction=1.0), node("b", fraction=1.0)]

    def scores(name):
        status, body = post(base, "prioritize", args(pod(name, annotation=URL, gpus=4), nodes))
        assert status == 200
        return {s["Host"]: s["Score"] for s in body}

    first = scores("p0")
    assert first["a"] == first["b"]
    ext.bound_pods["ml/p0"] = ("a", 4)
    second = scores("p1")
    assert second["a"] > second["b"] == first["b"]


@pytest.mark.parametrize("seed", range(5))
def test_achievable_locality_is_the_best_free_slots_of_the_candidates(seed):
    """The ranked shortcut gives what scoring every candidate would: random clusters, candidate subsets, gang
    sizes, nodes the cluster view does not know yet."""
    import random

    from scheduler_hints.scoring import best_slots_locality

    rng = random.Random(seed)
    ext = Extender()
    for i in range(60):
        ext.node_cache.update(node(f"n{i}", fraction=rng.choice([None, 0.0, 0.3, 0.5, 0.9, 1.0])))
    base, groups = ext.node_cache.cluster()
    needs = ext.needs(pod("p", annotation=URL, gpus=2))
    score = ext.priorities.locality(needs, groups)
    stranger = ext.node_cache.base_state(node("stranger", fraction=1.0))  # not in the cluster view
    for _ in range(20):
        cands = [replace(s, gpu_free=rng.choice([0, 1, 2, 4, 8])) for s in rng.sample(base, rng.randint(0, 60))]
        if rng.random() < 0.3:
            cands.append(replace(stranger, gpu_free=8))
        for count in (1, 3, 16):
            for per in (0, 2):
                want = best_slots_locality(((score(n), n.gpu_free // per if per else 1) for n in cands), count)
                assert ext.admission.achievable(needs, score, base, cands, count, per) == pytest.approx(want)


def _waiting(p: dict, share: str) -> dict:
    p["metadata"]["annotations"]["cachefs.io/wait-warm"] = share
    return p


def test_a_pod_that_waits_for_warm_data_runs_once_that_share_is_cached_where_it_can_land(server):
    """`cachefs.io/wait-warm: "90"`: the filter refuses, saying how warm the best node is, until 90 % of the pod's
    dataset is cached on a node it could run on; a pod without it runs at once (locality waits aside)."""
    base, ext = server
    ext.admission.locality_wait = 0  # (only the wait asked for)
    ext.node_cache.refresh_interval = 0  # (cache labels followed at once)
    nodes = [node("w1", fraction=0.6), node("w2", fraction=0.3)]
    for n in nodes:
        ext.node_cache.update(n)
    _, out = post(base, "filter", args(_waiting(pod("p", annotation=URL), "90"), nodes))
    reason = out["FailedNodes"].get("w1", "")
    assert not out["Nodes"]["items"] and "wait-warm 90 percent" in reason and "60 percent cached in node w1" in reason, out
    _, out = post(base, "filter", args(pod("q", annotation=URL), nodes))
    assert len(out["Nodes"]["items"]) == 2
    waiting = [p["metadata"]["name"] for p in ext.warm_waiting.values()]
    assert waiting == ["p"]  # kept, to be asked again when nodes change
    assert ext.warm_now() == [] and len(ext.warm_waiting) == 1  # (nothing changed: still waiting)
    warm = node("w1", fraction=0.95)
    ext.node_cache.update(warm)
    ready = ext.warm_now()  # what the cluster watch marks cachefs.io/warm-ready, for kube-scheduler to try again
    assert [r["metadata"]["name"] for r in ready] == ["p"] and not ext.warm_waiting
    _, out = post(base, "filter", args(_waiting(pod("p", annotation=URL), "90"), [warm, nodes[1]]))
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["w1", "w2"]
    _, out = post(base, "filter", args(_waiting(pod("r", annotation=URL), "not a number"), nodes))
    assert len(out["Nodes"]["items"]) == 2  # (a value it cannot read asks for nothing)


def test_a_pod_waiting_for_warm_data_is_told_when_it_will_be_warm_at_the_rate_it_warms(server):
    """The wait-warm reason says an ETA once the share where the pod could land has grown: at the mean rate since
    the refusal was first seen (20 % -> 50 % in 60 s: the 40 % still missing for 90 % in 80 s); none before it grew,
    and a share that fell (eviction) starts the count over."""
    base, ext = server
    ext.admission.locality_wait = 0
    ext.node_cache.refresh_interval = 0
    now = [1000.0]
    ext.admission.clock = lambda: now[0]

    def reason(fraction: float) -> str:
        n = node("w1", fraction=fraction)
        ext.node_cache.update(n)
        _, out = post(base, "filter", args(_waiting(pod("p", annotation=URL), "90"), [n]))
        assert not out["Nodes"]["items"], out
        return out["FailedNodes"]["w1"]

    assert "20 percent cached in node w1" in (said := reason(0.2)) and "ETA" not in said
    now[0] += 30
    assert "ETA" not in reason(0.2)  # (not grown yet)
    now[0] += 30
    assert (said := reason(0.5)).endswith("50 percent cached in node w1, ETA 80 s"), said
    now[0] += 600
    assert reason(0.86).endswith(", ETA 40 s")  # (66 % in 660 s: 4 % more at 0.1 % a second)
    now[0] += 10
    assert "ETA" not in reason(0.1)  # evicted: from here on
    now[0] += 10
    assert reason(0.3).endswith(", ETA 30 s")  # (20 % in 10 s since, not 10 % in 680 s)


def test_a_gang_waiting_for_warm_data_holds_nothing_until_its_group_holds_enough(server):
    base, ext = server
    ext.admission.locality_wait = 0
    ext.node_cache.refresh_interval = 0  # (cache labels are followed at once here, not every few seconds)
    nodes = [node("a1", fraction=0.4), node("a2", fraction=0.2)]
    for n in nodes:
        n["metadata"]["labels"]["cachefs.io/cache-group"] = "rack-a"
        ext.node_cache.update(n)
    members = [_waiting(pod(f"m{i}", annotation=URL, gpus=8, gang="wg", gang_size=2), "70") for i in range(2)]
    _, out = post(base, "filter", args(members[0], nodes))
    said = out["FailedNodes"]["a1"]
    assert "gang ml/wg" in said and "60 percent cached in group rack-a" in said, out
    assert not ext.gangs.admitted(pod_gang(members[0], {}))
    nodes[1] = node("a2", fraction=0.35)
    nodes[1]["metadata"]["labels"]["cachefs.io/cache-group"] = "rack-a"
    ext.node_cache.update(nodes[1])  # the group now holds 40 % + 35 %: the gang goes
    _, out = post(base, "filter", args(members[0], nodes))
    assert len(out["Nodes"]["items"]) == 2 and ext.gangs.admitted(pod_gang(members[0], {})), out["FailedNodes"]


def test_a_gang_waiting_for_gpus_has_the_group_it_will_land_in_warmed_meanwhile(server):
    """A gang that fits nowhere while other jobs hold the GPUs: the extender names the cache group it will land in
    (of those whose GPUs could hold it, the one holding most of its data) for the node agents there to warm its
    dataset; once it is admitted the target goes."""
    base, ext = server
    ext.admission.locality_wait = 0
    ext.node_cache.refresh_interval = 0
    layout = {"a1": ("rack-a", 0.1), "a2": ("rack-a", None), "b1": ("rack-b", 0.5), "b2": ("rack-b", 0.2),
              "b3": ("rack-b", None), "c1": ("rack-c", 0.9)}  # (rack-c's one node cannot hold the gang)
    nodes = []
    for name, (group, fraction) in layout.items():
        n = node(name, fraction=fraction)
        n["metadata"]["labels"]["cachefs.io/cache-group"] = group
        ext.node_cache.update(n)
        nodes.append(n)
        ext.bound_pods[f"busy/{name}"] = (name, 8)  # every GPU held by a running job
    members = [pod(f"g{i}", inline=URL, gpus=8, gang="pre", gang_size=2) for i in range(2)]
    _, out = post(base, "filter", args(members[0], nodes))
    assert not out["Nodes"]["items"] and "waiting until the whole gang fits" in out["FailedNodes"]["a1"], out
    assert ext.prewarm.wanted() == {"rack-b": [URL]}
    for name in ("a1", "a2"):
        del ext.bound_pods[f"busy/{name}"]  # a job ends: the gang fits now
    _, out = post(base, "filter", args(members[0], nodes))
    assert out["Nodes"]["items"] and ext.gangs.admitted(pod_gang(members[0], {})), out["FailedNodes"]
    assert ext.prewarm.wanted() == {}


def test_a_pod_does_not_wait_for_nodes_its_node_selector_rules_out(server):
    """Delay scheduling counts only nodes the pod could ever run on: a node holding 90 % of its data but outside
    its nodeSelector is not worth waiting for (it waited for one, up to locality_wait, in the e2e run)."""
    base, ext = server
    far, near = node("far", fraction=0.9), node("near", fraction=0.1)
    far["metadata"]["labels"]["zone"], near["metadata"]["labels"]["zone"] = "b", "a"
    for n in (far, near):
        ext.node_cache.update(n)
    p = pod("picky", annotation=URL)
    p["spec"]["nodeSelector"] = {"zone": "a"}
    _, out = post(base, "filter", args(p, [near]))
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["near"], out["FailedNodes"]
    _, out = post(base, "filter", args(pod("anywhere", annotation=URL), [near]))  # free to wait for "far"
    assert not out["Nodes"]["items"] and "waits up to" in out["FailedNodes"]["near"]


class _PatchRecorder:
    """Stands in for the API server's pod updates (the e2e run has the real one): the patches asked for."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, dict]] = []

    async def merge_patch(self, path: str, patch: dict) -> dict:
        self.patches.append((path, patch))
        return {}


def test_a_node_change_that_makes_a_waiting_pod_warm_marks_the_pod_for_kube_scheduler():
    """kube-scheduler tries a refused pod again on its next event; if that came before the extender's node watch saw
    the node turn warm, the pod was refused again. The watch marks such a pod once it has seen the change (a pod
    update is an event for kube-scheduler), and only such a pod."""
    from scheduler_hints.watch import ClusterWatch

    async def run() -> list[tuple[str, dict]]:
        ext = Extender()
        ext.admission.locality_wait = 0
        ext.node_cache.refresh_interval = 0  # (cache labels followed at once)
        client = _PatchRecorder()
        watch = ClusterWatch(client, ext)  # (its reflectors never start here)
        watch.TOUCH_DELAY = 0
        cold = node("w1", fraction=0.3)
        watch._on_node("ADDED", cold)
        for name in ("p", "q"):
            out = ext.filter(args(_waiting(pod(name, annotation=URL), "90" if name == "p" else "99"), [cold]))
            assert not out["Nodes"]["items"]
        watch._on_node("MODIFIED", node("w1", fraction=0.95))  # warm enough for p (90 %), not for q (99 %)
        assert watch._touching is not None
        await watch._touching
        assert [p["metadata"]["name"] for p in ext.warm_waiting.values()] == ["q"]
        return client.patches

    patches = asyncio.run(run())
    assert len(patches) == 1
    path, patch = patches[0]
    assert path.endswith("/pods/p") and patch["metadata"]["annotations"]["cachefs.io/warm-ready"].endswith("Z")


def test_volumes_that_name_a_cachedataset_count_as_its_url_in_the_pods_namespace():
    """`dataset: NAME` (inline, or a PV's attribute behind a claim) is the CacheDataset of that name in the pod's
    namespace, as the watch of CacheDatasets says it; another namespace's pod reads no such dataset; a `dataset`
    value that is a URL is read as one, as before CacheDatasets."""
    from cachefs.base.types import dataset_id
    from scheduler_hints.pods import pod_datasets
    from scheduler_hints.watch import WatchedVolumes

    volumes = WatchedVolumes()
    volumes.on_dataset("ADDED", {"metadata": {"namespace": "ml", "name": "imagenet"}, "spec": {"url": URL}})
    volumes.on_pv("ADDED", {"metadata": {"name": "pv-1"}, "spec": {"csi": {
        "driver": "csi.cachefs.io", "volumeAttributes": {"dataset": "imagenet"}}}})
    volumes.on_pvc("ADDED", {"metadata": {"namespace": "ml", "name": "claim"}, "spec": {"volumeName": "pv-1"}})

    def reader(namespace: str, volume: dict) -> dict:
        return {"metadata": {"namespace": namespace, "name": "r"}, "spec": {"volumes": [volume]}}

    inline = {"name": "d", "csi": {"driver": "csi.cachefs.io", "volumeAttributes": {"dataset": "imagenet"}}}
    claim = {"name": "d", "persistentVolumeClaim": {"claimName": "claim"}}
    assert pod_datasets(reader("ml", inline), volumes) == [dataset_id(URL)]
    assert pod_datasets(reader("ml", claim), volumes) == [dataset_id(URL)]
    assert pod_datasets(reader("other", inline), volumes) == []
    legacy = {"name": "d", "csi": {"driver": "csi.cachefs.io", "volumeAttributes": {"dataset": URL}}}
    assert pod_datasets(reader("other", legacy), volumes) == [dataset_id(URL)]
    volumes.on_dataset("DELETED", {"metadata": {"namespace": "ml", "name": "imagenet"}, "spec": {"url": URL}})
    assert pod_datasets(reader("ml", inline), volumes) == []

"""The cache group's Kubernetes side against a real API server, under the RBAC deploy/ ships: members are the
ready endpoints of the peer Service on nodes of the group (EndpointSlices and Nodes, listed then watched), and
peer tokens are checked by TokenReview (our audience, a node pod's service account, the node it runs on)."""

from __future__ import annotations

import asyncio

import pytest

from cachefs.cluster.auth import NODE_ACCOUNT, Forbidden, ReviewUnavailable, TokenReviewer, Unauthorized
from cachefs.cluster.membership import EndpointSliceWatch, MemberTable
from cachefs.kube import KubeClient, KubeConfig

from .test_scheduling import delete_pod, make_node, make_pod

pytestmark = pytest.mark.slow
NS = "cachefs-system"


def pod_token(k8s, pod: str, ns: str, account: str, audience: str | None = None) -> str:
    """A token bound to ``pod``, as kubelet projects it (``audience`` None: the API server's own)."""
    uid = k8s.request("GET", f"/api/v1/namespaces/{ns}/pods/{pod}")["metadata"]["uid"]
    spec = {"expirationSeconds": 3600, "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}}
    if audience:
        spec["audiences"] = [audience]
    return k8s.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{account}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})["status"]["token"]


def endpoint_slice(name: str, endpoints: dict[str, tuple[str, bool]]) -> dict:
    """What the EndpointSlice controller would write for the peer Service (no controller runs here)."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": "cachefs-peers"}},
            "ports": [{"name": "peer", "port": 7480, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "nodeName": node, "conditions": {"ready": ready}}
                          for node, (ip, ready) in endpoints.items()]}


def put(k8s, doc: dict) -> None:
    from .controlplane import collection_path

    k8s.request("PUT", f"{collection_path(doc)}/{doc['metadata']['name']}", doc)


def wait(check, what: str, timeout: float = 20.0):
    async def go():
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not check():
            assert loop.time() < end, what
            await asyncio.sleep(0.05)
    return go()


def test_members_are_ready_endpoints_on_nodes_of_the_group_and_tokens_are_reviewed(k8s):
    for name, group in (("grp-a", "rack-7"), ("grp-b", "rack-7"), ("grp-c", "rack-9")):
        make_node(k8s, name, labels={"cachefs.io/cache-group": group})
    for pod, node in (("agent-grp-a", "grp-a"), ("agent-grp-b", "grp-b")):
        k8s.apply(make_pod(pod, ns=NS, node=node, service_account="cachefs-node"))
    k8s.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant", "namespace": "default"}})
    k8s.apply(make_pod("tenant", node="grp-b", service_account="tenant"))  # any other tenant's pod
    agent_token = pod_token(k8s, "agent-grp-a", NS, "cachefs-node")
    k8s.apply(endpoint_slice("cachefs-peers-1", {"grp-a": ("10.1.0.1", True), "grp-b": ("10.1.0.2", True),
                                                 "grp-c": ("10.1.0.3", True)}))

    async def scenario():
        client = KubeClient(KubeConfig(k8s.server, token=agent_token, insecure=True))
        table = MemberTable("grp-a", grace=600)
        watch = EndpointSliceWatch(client, NS, "cachefs-peers", table, group="rack-7")
        task = asyncio.ensure_future(watch.run())
        try:
            await asyncio.wait_for(watch.synced.wait(), 20)
            assert sorted(table.members) == ["grp-a", "grp-b"]  # grp-c is ready but in another group
            assert table.member("grp-b").address == "10.1.0.2:7480"
            # grp-b's pod stops being ready: it drains (still placed), it does not vanish
            put(k8s, endpoint_slice("cachefs-peers-1", {"grp-a": ("10.1.0.1", True), "grp-b": ("10.1.0.2", False)}))
            await wait(lambda: table.draining() == ["grp-b"], "grp-b did not start draining")
            # grp-c joins the group by its label: the watch of the group's nodes brings it in
            k8s.request("PATCH", "/api/v1/nodes/grp-c", {"metadata": {"labels": {"cachefs.io/cache-group": "rack-7"}}},
                        content_type="application/merge-patch+json")
            put(k8s, endpoint_slice("cachefs-peers-1", {"grp-a": ("10.1.0.1", True), "grp-b": ("10.1.0.2", True),
                                                        "grp-c": ("10.1.0.3", True)}))
            await wait(lambda: sorted(table.members) == ["grp-a", "grp-b", "grp-c"] and not table.draining(),
                       "grp-c did not join")

            reviewer = TokenReviewer(client)
            peer = pod_token(k8s, "agent-grp-b", NS, "cachefs-node", "cachefs.io/peer")
            who = await reviewer.identify(peer)
            assert (who.node, who.pod, who.user) == ("grp-b", "agent-grp-b", NODE_ACCOUNT)
            assert reviewer.reviews == 1 and (await reviewer.identify(peer)) == who and reviewer.reviews == 1
            with pytest.raises(Unauthorized):  # a node pod's token for the API server, not for peers
                await reviewer.identify(pod_token(k8s, "agent-grp-b", NS, "cachefs-node"))
            with pytest.raises(Unauthorized):
                await reviewer.identify("not-a-token")
            with pytest.raises(Forbidden):  # a tenant's pod may ask for our audience; it is not a node pod
                await reviewer.identify(pod_token(k8s, "tenant", "default", "tenant", "cachefs.io/peer"))
            # The API server goes away: a token it accepted within STALE_TTL is still taken, any other is
            # "unavailable" (the peer server's 503 with Retry-After), never a 401 or a 500.
            reviewer.ttl = 0.0  # review again at every request
            down = KubeClient(KubeConfig("https://127.0.0.1:1", token=agent_token, insecure=True), timeout=5)
            reviewer.client = down
            try:
                assert (await reviewer.identify(peer)) == who
                with pytest.raises(ReviewUnavailable):
                    await reviewer.identify(pod_token(k8s, "agent-grp-a", NS, "cachefs-node", "cachefs.io/peer"))
            finally:
                await down.aclose()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        k8s.request("DELETE", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices/cachefs-peers-1")
        for pod, ns in (("agent-grp-a", NS), ("agent-grp-b", NS), ("tenant", "default")):
            delete_pod(k8s, pod, ns)
        for name in ("grp-a", "grp-b", "grp-c"):
            k8s.request("DELETE", f"/api/v1/nodes/{name}")
        k8s.request("DELETE", "/api/v1/namespaces/default/serviceaccounts/tenant")


def test_an_agent_outside_every_group_is_ready_and_joins_when_its_node_is_labelled(k8s, tmp_path):
    """README labels nodes after deploying: the node pod's agent starts outside every group, must still pass its
    readiness probe (/readyz on the peer port; before, nothing listened there and the DaemonSet was never Ready),
    and joins the group once the label comes, without a restart."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from .controlplane import free_port

    make_node(k8s, "lone-a")
    port = free_port()
    token = tmp_path / "token"
    token.write_text("unused-here")
    agent = subprocess.Popen(
        [sys.executable, "-m", "cachefs.cli.main", "agent", "-v", "--cache-dir", str(tmp_path / "cache"),
         "--node", "lone-a", "--listen", f"127.0.0.1:{port}", "--service", f"{NS}/cachefs-peers",
         "--kubeconfig", str(k8s.admin_kubeconfig), "--token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 30
        answer = None
        while answer is None and time.monotonic() < deadline:
            try:
                answer = urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).read()
            except OSError:
                time.sleep(0.2)
        assert answer is not None and b"no cache group" in answer
        k8s.request("PATCH", "/api/v1/nodes/lone-a", {"metadata": {"labels": {"cachefs.io/cache-group": "rack-5"}}},
                    content_type="application/merge-patch+json")
        joined = ""
        assert agent.stdout is not None
        while "joining the group" not in joined and time.monotonic() < deadline + 30:
            joined += agent.stdout.readline()
        assert "lone-a is now labelled cachefs.io/cache-group=rack-5: joining the group" in joined, joined
    finally:
        agent.terminate()
        agent.communicate(timeout=30)
        k8s.request("DELETE", "/api/v1/nodes/lone-a")

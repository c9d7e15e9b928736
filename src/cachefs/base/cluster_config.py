"""The ``cluster`` section of the configuration: the cache group a node belongs to (docs/CLUSTER.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachefs.base.errors import ConfigError
from cachefs.base.values import parse_listen, parse_size

__all__ = ["MAX_REPLICAS", "ClusterConfig", "parse_replicas"]

_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True)
class ClusterConfig:
    """The cache group this node belongs to (docs/CLUSTER.md). Empty ``group``: the node caches alone."""

    #: The group's name: one per rack or leaf, say. "" in Kubernetes: the ``cachefs.io/cache-group`` label of
    #: this node's Node (no label: the node reads through no group and serves none).
    group: str = ""
    #: This member's name: the node's ("" = ``$NODE_NAME``, else the host name).
    node_name: str = ""
    #: Where the agent's peer server listens, HOST:PORT.
    listen: str = "0.0.0.0:7480"
    #: How the other members reach this one, HOST:PORT ("" = ``$POD_IP`` and the listen port).
    advertise: str = ""
    #: Datasets this node fetches from the origin for the group when it owns a key of them, with the node's own
    #: origin settings: "*" any dataset a member of the group reads (learnt from the members' requests and pushed
    #: manifests; never file:// or local://), or URL prefixes separated by commas, or "none": only datasets a
    #: reader on this node opened itself (docs/SECURITY.md: what a member can make another fetch).
    serve: str = "*"
    #: A static member list, ``name=host:port[@weight],…`` (one host, tests); "" = the Kubernetes API.
    peers: str = ""
    #: The headless Service over the node pods, NAMESPACE/NAME: its ready endpoints on nodes of this group (by
    #: their ``cachefs.io/cache-group`` label) are the members.
    service: str = "cachefs-system/cachefs-peers"
    #: This member's projected ServiceAccount token (audience ``cachefs.io/peer``) sent with every request.
    token_file: str = "/var/run/secrets/cachefs/token"
    #: Instead of tokens and TokenReview: a file with a secret shared by the group (one host, tests).
    secret_file: str = ""
    #: A member gone from the API stays placed, asked last, this many seconds (a restarting pod keeps its keys).
    drain_grace: float = 600.0
    #: A peer that has not answered within this many seconds gets company: the next candidate is asked too.
    hedge_after: float = 0.25
    #: Store what this node reads from peers (blocks and small files) on its disk too, as guest data: evicted
    #: before anything the node owns, so hot data replicates to where it is read without crowding out the node's
    #: share of the group's cache. Off, what peers send is kept in memory only (docs/CLUSTER.md).
    keep_guest: bool = True
    #: A directory served faster than this by one member is hot: its keys get ``hot_replicas`` more holders.
    hot_requests_per_s: float = 1000.0
    #: The same in bytes per second, e.g. ``200MB``; "" = a quarter of the speed of the node's fastest NIC.
    hot_bytes_per_s: str = ""
    #: Extra holders of a hot directory's keys (the next rendezvous candidates; 0 = never spread).
    hot_replicas: int = 2
    #: Sets known in advance to be hot, ``URL-PREFIX=N,…``: keys under a prefix always have N extra holders.
    replicas: str = ""
    #: TLS between members (files from a Secret, PEM): the group's certificate and key, which every member serves
    #: and presents as a client, and the CA that signed it. All three, or none (plain HTTP).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    #: The largest manifest another member may push to this one (413 past it; the member then lists for itself).
    max_manifest_push: str = "256MiB"
    #: Open connections one client address may hold to the peer server (more are closed at once).
    max_client_connections: int = 128
    #: Seconds a connection to the peer server may go without a whole request (idle, or a head half sent).
    idle_timeout: float = 30.0

    def validate(self) -> None:
        """ConfigError naming the first bad value."""
        k = self
        if k.group and not _LABEL_VALUE.fullmatch(k.group):
            raise ConfigError(f"cluster.group {k.group!r}: not a Kubernetes label value (63 characters of "
                              "[A-Za-z0-9._-], starting and ending alphanumeric)")
        parse_listen(k.listen, "cluster.listen")
        if k.advertise:
            parse_listen(k.advertise, "cluster.advertise")
        ns, sep, name = k.service.partition("/")
        if not sep or not ns or not name:
            raise ConfigError(f"cluster.service {k.service!r}: expected NAMESPACE/NAME")
        if k.drain_grace < 0 or k.hedge_after <= 0:
            raise ConfigError("need cluster.drain_grace >= 0 and cluster.hedge_after > 0")
        if not k.hot_requests_per_s > 0:
            raise ConfigError("cluster.hot_requests_per_s must be positive")
        if k.hot_bytes_per_s and parse_size(k.hot_bytes_per_s, "cluster.hot_bytes_per_s") <= 0:
            raise ConfigError("cluster.hot_bytes_per_s must be positive")
        if parse_size(k.max_manifest_push, "cluster.max_manifest_push") < 1 << 20:
            raise ConfigError("cluster.max_manifest_push must be at least 1MiB")
        if k.max_client_connections < 1:
            raise ConfigError("cluster.max_client_connections must be at least 1")
        if not k.idle_timeout > 0:
            raise ConfigError("cluster.idle_timeout must be positive")
        if not 0 <= k.hot_replicas <= MAX_REPLICAS:
            raise ConfigError(f"cluster.hot_replicas must be between 0 and {MAX_REPLICAS}")
        parse_replicas(k.replicas)
        if k.serve.strip() not in ("*", "none", "") and any(
                "://" not in p for p in k.serve.split(",") if p.strip()):
            raise ConfigError(f"cluster.serve {k.serve!r}: expected *, none, or dataset URL prefixes separated by "
                              "commas (s3://bucket/prefix,…)")
        tls = (k.tls_cert, k.tls_key, k.tls_ca)
        if any(tls) and not all(tls):
            raise ConfigError("cluster.tls_cert, cluster.tls_key and cluster.tls_ca go together")


#: Most extra holders a key can have: placement keeps four candidates per slot (cluster.placement.RANK).
MAX_REPLICAS = 3


def parse_replicas(spec: str) -> list[tuple[str, int]]:
    """``cluster.replicas``: ``URL-PREFIX=N,…`` → [(prefix, N)], longest prefix first."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        prefix, eq, n = part.rpartition("=")
        if not eq or "://" not in prefix or not n.isdigit() or not 1 <= int(n) <= MAX_REPLICAS:
            raise ConfigError(f"cluster.replicas: {part!r} is not URL-PREFIX=N with 1 <= N <= {MAX_REPLICAS}")
        out.append((prefix.rstrip("/"), int(n)))
    return sorted(out, key=lambda pn: -len(pn[0]))

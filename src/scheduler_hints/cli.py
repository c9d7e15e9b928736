"""The ``cachefs labels``, ``cachefs scheduler-extender``, ``cachefs publish-labels`` and ``cachefs dataset-controller``
commands, registered with the ``cachefs`` command through the ``cachefs.commands`` entry point (so that the cachefs
package never imports this one)."""

from __future__ import annotations

import argparse

from cachefs.base.config import Config
from cachefs.base.errors import CacheFSError, ConfigError
from cachefs.cli.output import print_json

__all__ = ["add_commands", "dataset_controller", "extender_tls", "labels", "publish_labels", "scheduler_extender"]


def add_commands(sub, groups: dict[str, argparse.ArgumentParser]) -> None:
    """Add this package's subcommands to ``cachefs`` (``groups``: its shared option groups)."""
    base, cache = groups["base"], groups["cache"]
    lb = sub.add_parser("labels", parents=[base],
                        help="print (JSON) the node labels/annotations a node holding this much would publish")
    lb.add_argument("url")
    lb.add_argument("--cached", required=True, help="bytes cached on the node, e.g. 900GB")
    lb.add_argument("--total", required=True, help="dataset size, e.g. 1TB")
    lb.add_argument("--free", default="0", help="free cache space on the node")
    lb.add_argument("--cache-group", help="the node's cache group (rack, cell)")
    lb.set_defaults(run="scheduler_hints.cli:labels")

    se = sub.add_parser("scheduler-extender", parents=[base], help="run the kube-scheduler extender")
    se.add_argument("--listen", default="127.0.0.1:8888",
                    help="HOST:PORT (default 127.0.0.1:8888: a sidecar of kube-scheduler); any other address "
                         "needs --tls-cert, --tls-key and --client-ca")
    se.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    se.add_argument("--tls-key", help="the certificate's private key (PEM)")
    se.add_argument("--client-ca", help="accept only clients with a certificate from this CA (kube-scheduler's, "
                                        "its extender tlsConfig)")
    se.add_argument("--extender-config", dest="extender_config", help="YAML: weights, bind_timeout, gang_ttl")
    se.add_argument("--kubeconfig", help="kubeconfig for the watches and bindings (default: in-cluster, $KUBECONFIG)")
    se.add_argument("--standalone", action="store_true",
                    help="no API server: node details only from requests, bindings only recorded (testing)")
    se.add_argument("--metrics-listen", metavar="HOST:PORT",
                    help="serve the extender's Prometheus metrics here (docs/METRICS.md)")
    se.set_defaults(run="scheduler_hints.cli:scheduler_extender")

    pl = sub.add_parser("publish-labels", parents=[base, cache],
                        help="keep this node's cache-locality labels current (node agent loop)")
    pl.add_argument("--node", help="Node name (default: env NODE_NAME, set from the downward API)")
    pl.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster service account, then $KUBECONFIG)")
    pl.add_argument("--cache-group", help="this node's cache group label value (rack, cell)")
    pl.add_argument("--interval", type=float, default=10.0, help="seconds between checks (default 10)")
    pl.add_argument("--min-interval", type=float, default=30.0, help="at most one PATCH per this many seconds")
    pl.add_argument("--once", action="store_true", help="publish once and exit")
    pl.set_defaults(run="scheduler_hints.cli:publish_labels")

    dc = sub.add_parser("dataset-controller", parents=[base],
                        help="keep every CacheDataset's status from the node agents' accounting (docs/DATASETS.md)")
    dc.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster service account, then $KUBECONFIG)")
    dc.add_argument("--interval", type=float, default=5.0, help="seconds between passes (default 5)")
    dc.add_argument("--once", action="store_true", help="one pass, then exit")
    dc.add_argument("--lease", default="", metavar="NAMESPACE/NAME",
                    help="with several replicas: only the one holding this Lease writes (default: none)")
    dc.set_defaults(run="scheduler_hints.cli:dataset_controller")


async def labels(args: argparse.Namespace, config: Config) -> int:
    from cachefs.base.config import parse_size
    from cachefs.base.types import DatasetRef, dataset_id
    from scheduler_hints.labels import DatasetCache, LabelError, NodeCacheSummary, desired_metadata

    cached, total = parse_size(args.cached, "--cached"), parse_size(args.total, "--total")
    ds = DatasetCache(DatasetRef.from_url(args.url).url, dataset_id(args.url), cached, total)
    summary = NodeCacheSummary((ds,), parse_size(args.free, "--free"), 0, cached, args.cache_group)
    try:
        lab, ann = desired_metadata(summary)
    except LabelError as exc:
        raise ConfigError(str(exc)) from None
    print_json({"labels": lab, "annotations": ann})
    return 0


async def scheduler_extender(args: argparse.Namespace, config: Config) -> int:
    from scheduler_hints.config import load_extender_config
    from scheduler_hints.dra import DraInventory
    from scheduler_hints.extender import Extender
    from scheduler_hints.extender_http import serve
    from scheduler_hints.gang import GangManager

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {args.listen!r}: expected HOST:PORT")
    ssl_context = extender_tls(args.listen, host.strip("[]"), args.tls_cert, args.tls_key, args.client_ca)
    cfg = load_extender_config(args.extender_config)
    if args.metrics_listen:
        from prometheus_client import start_http_server

        from cachefs.base.config import parse_listen

        metrics_host, metrics_port = parse_listen(args.metrics_listen, "--metrics-listen")
        start_http_server(metrics_port, addr=metrics_host)
    binder = client = None
    if not args.standalone:
        from cachefs.kube import KubeClient, load_kube_config
        from scheduler_hints.watch import KubeBinder

        client = KubeClient(load_kube_config(args.kubeconfig))
        binder = KubeBinder(client)
    ext = Extender(weights=cfg.weights, gangs=GangManager(ttl=cfg.gang_ttl, bind_timeout=cfg.bind_timeout),
                   dra=DraInventory(cfg.dra), binder=binder, topology_wait=cfg.topology_wait,
                   locality_wait=cfg.locality_wait, locality_slack=cfg.locality_slack)
    if client is None:
        await serve(ext, host.strip("[]"), int(port), ssl_context, int(cfg.max_request_bytes))
        return 0
    from scheduler_hints.watch import ClusterWatch

    watch = ClusterWatch(client, ext)
    try:
        await watch.start()
        await serve(ext, host.strip("[]"), int(port), ssl_context, int(cfg.max_request_bytes))
    finally:
        await watch.aclose()
        await client.aclose()
    return 0


def extender_tls(listen: str, host: str, cert: str | None, key: str | None, client_ca: str | None):
    """The extender's TLS context, or None on a loopback address. The extender binds pods with its own rights,
    so it is never reachable over the network without proof of who asks: anywhere but loopback it serves
    HTTPS and requires a client certificate from ``client_ca`` (docs/SECURITY.md)."""
    import ipaddress
    import ssl

    if not (cert or key or client_ca):
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(f"--listen {listen}: the extender binds pods, so it listens on a loopback address "
                              "(as a sidecar of kube-scheduler) unless --tls-cert, --tls-key and --client-ca "
                              "require kube-scheduler's client certificate (docs/SECURITY.md)")
        return None
    if not (cert and key and client_ca):
        raise ConfigError("--tls-cert, --tls-key and --client-ca go together (a server certificate alone would "
                          "let any client in)")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
        context.load_verify_locations(cafile=client_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"extender TLS: {exc}") from None
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


async def publish_labels(args: argparse.Namespace, config: Config) -> int:
    import os

    from cachefs.kube import ApiError, KubeClient, load_kube_config
    from scheduler_hints.labels import validate_label_value
    from scheduler_hints.publisher import Publisher, rbac_hint
    from scheduler_hints.summary import IndexSummary

    node = args.node or os.environ.get("NODE_NAME")
    if not node:
        raise ConfigError("publish-labels: no node name (--node or env NODE_NAME from the downward API)")
    if args.cache_group:
        try:
            validate_label_value(args.cache_group)
        except ValueError as exc:
            raise ConfigError(f"--cache-group: {exc}") from None
    if args.interval <= 0 or args.min_interval < 0:
        raise ConfigError("--interval must be positive and --min-interval not negative")
    client = KubeClient(load_kube_config(args.kubeconfig))
    pub = Publisher(client, node, IndexSummary(config, args.cache_group), min_interval=args.min_interval)
    try:
        if args.once:
            try:
                result = await pub.publish_once(force=True)
            except ApiError as exc:
                raise CacheFSError(f"node {node}: {exc}{rbac_hint(exc)}") from None
            print_json({"node": node, "patched": result.patched, "labels_set": list(result.labels_changed),
                        "labels_removed": list(result.labels_removed)})
        else:
            await pub.run(args.interval)
    finally:
        await client.aclose()
    return 0


async def dataset_controller(args: argparse.Namespace, config: Config) -> int:
    import os

    from cachefs.kube import ApiError, KubeClient, load_kube_config
    from scheduler_hints.datasets import DatasetController

    if not args.interval > 0:
        raise ConfigError("--interval must be positive")
    client = KubeClient(load_kube_config(args.kubeconfig))
    if args.lease and "/" not in args.lease:
        raise ConfigError(f"--lease {args.lease!r}: expected NAMESPACE/NAME")
    controller = DatasetController(client, interval=args.interval, lease=args.lease,
                                   identity=os.environ.get("POD_NAME", ""))
    try:
        if args.once:
            try:
                print_json({"written": await controller.once()})
            except ApiError as exc:
                raise CacheFSError(f"dataset controller: {exc}") from None
        else:
            await controller.run()
    finally:
        await client.aclose()
    return 0

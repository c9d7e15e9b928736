"""The ``cachefs csi`` and ``cachefs csi-mounter`` commands, registered with the ``cachefs`` command through the
``cachefs.commands`` entry point (so that the cachefs package never imports this one)."""

from __future__ import annotations

import argparse
import os

from cachefs.base.config import Config
from cachefs.base.errors import ConfigError

__all__ = ["add_commands", "csi", "csi_mounter"]


def add_commands(sub, groups: dict[str, argparse.ArgumentParser]) -> None:
    """Add this package's subcommands to ``cachefs`` (``groups``: its shared option groups)."""
    base, cache = groups["base"], groups["cache"]
    cs = sub.add_parser("csi", parents=[base, cache], help="run the CSI plugin (node and/or controller)")
    cs.add_argument("--endpoint", default="unix:///csi/csi.sock", help="gRPC socket (default unix:///csi/csi.sock)")
    cs.add_argument("--node-id", default=os.environ.get("NODE_NAME", ""), help="this node's name (env NODE_NAME)")
    cs.add_argument("--cache-group", default="", help="topology segment reported to Kubernetes (rack, zone)")
    cs.add_argument("--state-dir", help="sessions and publish records (default: <cache dir>/csi)")
    cs.add_argument("--mode", choices=("node", "controller", "both"), default="both")
    cs.add_argument("--mounter", default="",
                    help="socket of `cachefs csi-mounter` (unix:///run/cachefs/mounter.sock) to start FUSE sessions "
                         "in its container; default: this process starts them")
    cs.add_argument("--session-idle-timeout", type=float, default=600.0,
                    help="seconds a dataset's FUSE session runs with no pod using it (default 600; the cache stays)")
    cs.add_argument("--metrics-listen", metavar="HOST:PORT",
                    help="serve Prometheus metrics here (the node pod's metrics are served by csi-mounter)")
    cs.add_argument("--session-keeper", default="",
                    help="socket where the node plugin keeps a copy of every FUSE session's descriptor "
                         "(unix:///run/cachefs/keeper.sock, shared with csi-mounter), so sessions outlive a restart "
                         "of the mounter's container")
    cs.add_argument("--registration-dir", default="",
                    help="kubelet's plugin registration directory as this process sees it (/var/lib/kubelet/"
                         "plugins_registry mounted in): register the node plugin with kubelet (no registrar sidecar)")
    cs.add_argument("--kubelet-registration-path", default="",
                    help="the CSI socket's path on the node, as kubelet sees it "
                         "(/var/lib/kubelet/plugins/csi.cachefs.io/csi.sock)")
    cs.add_argument("--kubeconfig", default=None,
                    help="API access for volumes that name a CacheDataset (default: in-cluster, or $KUBECONFIG)")
    cs.add_argument("--handover-wait", type=float, default=0.0, metavar="SECONDS",
                    help="stopped, keep serving up to this long while the session keeper still keeps sessions: until "
                         "the next node pod takes them over, or, with none coming, their pods end and they are "
                         "unmounted (default 0; the DaemonSet sets it just under its grace period)")
    cs.set_defaults(run="csi.cli:csi", node_process=True)

    cm = sub.add_parser("csi-mounter", parents=[base, cache],
                        help="start FUSE sessions for the CSI node plugin (its own container, so that sessions "
                             "outlive plugin restarts)")
    cm.add_argument("--socket", default="unix:///run/cachefs/mounter.sock",
                    help="where to listen (default unix:///run/cachefs/mounter.sock)")
    cm.add_argument("--state-dir", help="the plugin's state directory; sessions are mounted only under it "
                                        "(default: <cache dir>/csi)")
    cm.add_argument("--session-keeper", default="",
                    help="the node plugin's session keeper (cachefs csi --session-keeper): holders keep a copy of "
                         "their descriptor there, and sessions left by a previous run of this container are adopted")
    cm.add_argument("--metrics-listen", metavar="HOST:PORT",
                    help="serve the node's Prometheus metrics here: every cachefs process of the node pod, and what "
                         "the cache holds (docs/METRICS.md)")
    cm.add_argument("--handover-wait", type=float, default=0.0, metavar="SECONDS",
                    help="stopped, wait up to this long for every session held here to be taken over by the next "
                         "node pod or to end, before leaving (leaving ends them; default 0)")
    cm.add_argument("--ready-file", default="", metavar="PATH",
                    help="made once sessions of an earlier node pod are taken over, and only while none is left with "
                         "it that this one cannot take (the node pod's readiness probe tests it)")
    cm.set_defaults(run="csi.cli:csi_mounter", node_process=True)


async def csi(args: argparse.Namespace, config: Config) -> int:
    from csi.server import serve, socket_path

    if args.session_idle_timeout < 0:
        raise ConfigError("--session-idle-timeout must be 0 or more seconds")
    if not args.handover_wait >= 0:
        raise ConfigError("--handover-wait must be 0 or more seconds")
    state_dir = args.state_dir or os.path.join(config.cache.dir, "csi")
    _serve_metrics(args, config)
    # In this (the main) thread, so that SIGTERM stops the server gracefully.
    serve(args.endpoint, node_id=args.node_id, cache_dir=config.cache.dir, state_dir=state_dir,
          cache_group=args.cache_group, mounter=args.mounter, session_idle_timeout=args.session_idle_timeout,
          node=args.mode != "controller", controller=args.mode != "node",
          registration_dir=args.registration_dir, kubelet_registration_path=args.kubelet_registration_path,
          session_keeper=socket_path(args.session_keeper) if args.session_keeper else "",
          handover_wait=args.handover_wait, kubeconfig=args.kubeconfig)
    return 0


async def csi_mounter(args: argparse.Namespace, config: Config) -> int:
    from csi.mounter import serve_mounter
    from csi.server import socket_path

    if not args.handover_wait >= 0:
        raise ConfigError("--handover-wait must be 0 or more seconds")
    state_dir = args.state_dir or os.path.join(config.cache.dir, "csi")
    _serve_metrics(args, config)
    serve_mounter(socket_path(args.socket), os.path.join(state_dir, "sessions"), config.cache.dir,
                  keeper=socket_path(args.session_keeper) if args.session_keeper else "",
                  handover_wait=args.handover_wait, ready_file=args.ready_file)
    return 0


def _serve_metrics(args: argparse.Namespace, config: Config) -> None:
    if args.metrics_listen:
        from cachefs.base.config import parse_listen
        from cachefs.status.server import serve_metrics

        serve_metrics(config, *parse_listen(args.metrics_listen, "--metrics-listen"))

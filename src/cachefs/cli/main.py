"""``cachefs``: prefetch, status, evict, refresh, mount, sync, checkpoints, demo.

Errors end the command with one line on stderr and an exit code that says what kind of failure it was
(see ``EXIT_CODES``); ``-v`` adds logs, never credentials.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import importlib
import logging
import signal
import sys
from importlib.metadata import entry_points
from typing import Any

from cachefs.base.collector import quiet_collector
from cachefs.base.config import Config, load_config
from cachefs.base.errors import (
    CacheFSError,
    CacheFullError,
    ConfigError,
    CredentialsError,
    InvalidURLError,
    ObjectNotFoundError,
    OriginUnavailableError,
)
from cachefs.cli.which_cache import TARGETS, cache_for, told

__all__ = ["EXIT_CODES", "main"]

#: Exit status per error class (first match wins); anything else that is a CacheFSError or OSError is 1.
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (InvalidURLError, 2),
    (ConfigError, 2),
    (CredentialsError, 3),
    (OriginUnavailableError, 4),
    (CacheFullError, 5),
    (ObjectNotFoundError, 6),
]


_EPILOG = """\
exit codes:
  0  done
  1  failed (the message says why; e.g. some files could not be cached)
  2  bad input: URL, option, configuration, mount point, cache directory
  3  credentials missing or refused by the origin
  4  origin unreachable
  5  cache disk full
  6  not found: dataset, prefix, bucket, cache directory
  130 interrupted

environment:
  CACHEFS_CONFIG                 YAML config file (--config)
  CACHEFS_<SECTION>_<FIELD>      any config value, e.g. CACHEFS_CACHE_DIR, CACHEFS_CACHE_CAPACITY,
                                 CACHEFS_ENGINE_MEMORY_BUDGET (docs/CONFIGURATION.md lists them all)
  AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN
                                 the S3 origin, as for the aws CLI
  NODE_NAME                      this node (publish-labels, csi)
"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cachefs")
    except PackageNotFoundError:
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    # Option groups; each subcommand takes only those that mean something to it.
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    cache = argparse.ArgumentParser(add_help=False)
    g = cache.add_argument_group("cache")
    g.add_argument("--cache-dir", help="cache directory (env CACHEFS_CACHE_DIR; default /var/cache/cachefs as root)")
    g.add_argument("--config", help="YAML config file (env CACHEFS_CONFIG)")
    capacity = argparse.ArgumentParser(add_help=False)
    g = capacity.add_argument_group("limits")
    g.add_argument("--capacity", help="cache size limit, e.g. 500GiB or 90%% (env CACHEFS_CACHE_CAPACITY)")
    g.add_argument("--memory-budget", help="in-flight memory ceiling, e.g. 512MiB (env CACHEFS_ENGINE_MEMORY_BUDGET)")
    origin = argparse.ArgumentParser(add_help=False)
    g = origin.add_argument_group("origin")
    g.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
    g.add_argument("--region", help="S3 region (default: AWS_REGION / profile)")
    g.add_argument("--profile", help="AWS profile (default: AWS_PROFILE)")
    common = [base, cache, capacity, origin]

    p = argparse.ArgumentParser(prog="cachefs", description="Node-local read-through cache for datasets on object storage.",
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"cachefs {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pf = sub.add_parser("prefetch", parents=common, help="fetch a dataset (or part of it) into the cache")
    pf.add_argument("url", help="dataset URL, e.g. s3://bucket/prefix or file:///data")
    pf.add_argument("--include", action="append", metavar="GLOB", help="only paths matching (repeatable)")
    pf.add_argument("--exclude", action="append", metavar="GLOB", help="skip paths matching (repeatable)")
    pf.add_argument("--workers", type=int, default=64, help="files fetched at once (default 64)")
    pf.add_argument("--refresh", action="store_true", help="take a new manifest snapshot first")
    pf.add_argument("--manifest-version", type=int, help="use this manifest snapshot")
    pf.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pf.add_argument("--json", action="store_true", help="print the summary as JSON (implies --quiet)")

    pk = sub.add_parser("pack", parents=common,
                        help="write a packed mirror of a dataset's small files to object storage (cold reads "
                             "then fetch a few large packs instead of one object per file)")
    pk.add_argument("url", help="dataset URL, e.g. s3://bucket/imagenet")
    pk.add_argument("--to", help="where to write it (default: <url>.cachefs, where every node looks for it)")
    pk.add_argument("--refresh", action="store_true", help="take a new manifest snapshot first")
    pk.add_argument("--json", action="store_true", help="print the summary as JSON")

    st = sub.add_parser("status", parents=[base, cache], help="capacity, usage and per-dataset cached fraction")
    st.add_argument("target", nargs="?",
                    help="a mount point or a dataset or volume URL: the status of the cache that serves it (without "
                         "--cache-dir)")
    st.add_argument("--json", action="store_true", help="machine-readable output")

    pn = sub.add_parser("pin", parents=[base, cache],
                        help="keep a dataset on this node: eviction passes it over (cachefs evict still removes it)")
    pn.add_argument("url", help="the dataset")
    pn.add_argument("--remove", action="store_true", help="let eviction take it again")
    ev = sub.add_parser("evict", parents=[base, cache], help="remove cached data (objects in use are kept)")
    ev.add_argument("url", nargs="?", help="dataset whose data to evict")
    ev.add_argument("--all", action="store_true", help="evict every dataset")
    ev.add_argument("--group", action="store_true",
                    help="the dataset on every member of this node's cache group too (a purge: docs/SECURITY.md)")

    od = sub.add_parser("order", parents=[base, cache],
                        help="publish the order a job will read a dataset in (the cache fetches ahead of it)")
    od.add_argument("dataset", help="the dataset's URL, or a cachefs mount point of it")
    how = od.add_mutually_exclusive_group(required=True)
    how.add_argument("--file", help="the paths in reading order, one a line ('-': standard input)")
    how.add_argument("--sampler", metavar="SPEC",
                     help="compute the orders of a known sampler instead, e.g. torch-distributed:seed=0,world-size=8,"
                          "ranks=0-7,under=train,match=*.JPEG (one order per rank; docs/SEMANTICS.md, Epochs)")
    od.add_argument("--epoch", type=int, help="the epoch it is for (shown by cachefs status; with --sampler, the "
                                              "epoch whose orders to compute, default its start-epoch)")
    od.add_argument("--publisher", default="cli",
                    help="whose order it is (default: cli); a later order of the same publisher replaces the earlier "
                         "one, so a job that runs this every epoch leaves one order, not one per run")

    rf = sub.add_parser("refresh", parents=[base, cache, origin], help="take a new manifest snapshot of a dataset")
    rf.add_argument("url")

    mt = sub.add_parser("mount", parents=common,
                        help="mount a dataset read-only, or with --writable a checkpoint volume (FUSE)")
    mt.add_argument("url", help="dataset URL (with --writable: the S3 prefix checkpoints go to)")
    mt.add_argument("mountpoint", help="an existing directory")
    mt.add_argument("--foreground", action="store_true",
                    help="stay in the foreground until unmounted (this process holds the mount and restarts "
                         "the serving daemon if it dies)")
    mt.add_argument("--workers", type=int, default=4,
                    help="FUSE request threads (default 4): one reads and answers quick requests, the others "
                         "copy large reads meanwhile; none waits on the origin")
    mt.add_argument("--no-passthrough", action="store_true",
                    help="serve every read from userspace, even for fully cached files")
    mt.add_argument("--no-prefill", action="store_true",
                    help="do not put a packed small file into the kernel's page cache at its first open (its "
                         "reads then come through userspace as READ requests)")
    mt.add_argument("--keep-opens", action="store_true",
                    help="have the kernel send OPEN and RELEASE for every file (by default they stop once every "
                         "file of the dataset is a packed small file on this node: then no open needs an answer)")
    mt.add_argument("--io-uring", choices=("off", "auto"), default="off",
                    help="auto: take requests from the kernel through io_uring where the fuse module allows it "
                         "(root: echo Y > /sys/module/fuse/parameters/enable_uring; Linux 6.14+), else /dev/fuse. "
                         "Default off: measured slower here, and a daemon that dies loses the requests it held "
                         "(docs/SEMANTICS.md); read-only mounts")
    mt.add_argument("--answer-after", type=float, default=10.0, metavar="SECONDS",
                    help="when the serving daemon dies and cannot be started again, readers wait this long, then "
                         "get errors (EIO; ENOTCONN for statfs) until it can (default 10)")
    mt.add_argument("--allow-other", action="store_true",
                    help="let every user of this machine read the mount (by default only the user who mounted it; "
                         "as another user than root, /etc/fuse.conf must say user_allow_other)")
    mt.add_argument("--group", metavar="GROUP",
                    help="files belong to this group (a name or id) and, unless --mode says otherwise, only it (and "
                         "the owner) may read them: with --allow-other, a mount for one group of users")
    mt.add_argument("--mode", metavar="OCTAL",
                    help="read bits of the files (0444, 0440, 0400; directories add the search bits); default 0444, "
                         "or 0440 with --group. Readers other than the mounting user need --allow-other too")
    mt.add_argument("--nonempty", action="store_true",
                    help="mount over a directory that has entries (they are hidden until unmounted)")
    mt.add_argument("--sampler", metavar="SPEC",
                    help="the readers' sampler, e.g. torch-distributed:seed=0,world-size=8,ranks=0-7: the mount "
                         "publishes each epoch's order itself, one epoch ahead (docs/SEMANTICS.md, Epochs)")
    mt.add_argument("--writable", action="store_true",
                    help="a checkpoint volume: files written there are durable on this node at close and fsync, and "
                         "go to the origin in the background, in the order they were closed; a directory renamed "
                         "from D.tmp to D is committed (docs/SEMANTICS.md, Checkpoints)")
    mt.add_argument("--attach", help=argparse.SUPPRESS)  # internal: serve the mount held at this socket
    # internal: hold a mount whose holder died, on the descriptor the session keeper kept (CACHEFS_SESSION_KEEPER)
    mt.add_argument("--adopt", action="store_true", help=argparse.SUPPRESS)

    um = sub.add_parser("umount", parents=[base, cache], help="unmount a cachefs mount")
    um.add_argument("mountpoint")
    um.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                    help="a writable mount: wait this long for its uploads first (default 600); what is left stays "
                         "queued on this node for the next mount or cachefs sync")
    um.add_argument("--no-sync", action="store_true", help="a writable mount: unmount without waiting for uploads")

    sy = sub.add_parser("sync", parents=[base, cache, origin],
                        help="wait until every file closed so far in writable volumes is on the origin")
    sy.add_argument("target", nargs="?",
                    help="a writable mount point (or a directory in one), or a volume URL; default: every volume "
                         "on this node")
    sy.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after this long (exit 1, naming what "
                                                                     "is pending)")
    sy.add_argument("--commit", action="store_true",
                    help="commit the directory TARGET as a checkpoint first (its commit record is written after "
                         "its files)")
    ck = sub.add_parser("checkpoints", parents=[base, cache, origin],
                        help="list the checkpoints committed under a URL, with their sizes")
    ck.add_argument("url", help="e.g. s3://bucket/run-17")
    ck.add_argument("--json", action="store_true", help="machine-readable output")

    dm = sub.add_parser("demo", parents=[base, cache, capacity],
                        help="start a local S3 server with a sample dataset, prefetch it and read it back")
    dm.add_argument("--small-files", type=int, default=3000)
    dm.add_argument("--large-files", type=int, default=3)
    dm.add_argument("--large-size", default="64MiB")
    mx = sub.add_parser("metrics", parents=[base, cache],
                        help="serve this node's Prometheus metrics: every cachefs process's, and what the cache holds")
    mx.add_argument("--listen", default="127.0.0.1:9808", help="HOST:PORT (default 127.0.0.1:9808)")
    ag = sub.add_parser("agent", parents=common,
                        help="run this node's agent: serve its cache group (peer server, membership), /healthz, "
                             "/readyz and, with --metrics-listen, the node's metrics (docs/CLUSTER.md)")
    g = ag.add_argument_group("cache group (docs/CLUSTER.md; each also a cluster.* setting)")
    g.add_argument("--group", dest="cluster_group",
                   help="the cache group's name (cluster.group; default in Kubernetes: the Node's cachefs.io/cache-group label)")
    g.add_argument("--node", dest="cluster_node_name", help="this member's name (default: $NODE_NAME, host name)")
    g.add_argument("--listen", dest="cluster_listen", help="peer server HOST:PORT (default 0.0.0.0:7480)")
    g.add_argument("--advertise", dest="cluster_advertise", help="HOST:PORT the members reach this one at")
    g.add_argument("--peers", dest="cluster_peers",
                   help="static members NAME=HOST:PORT[@WEIGHT],... instead of the Kubernetes API")
    g.add_argument("--service", dest="cluster_service",
                   help="NAMESPACE/NAME of the headless Service over the node pods (default cachefs-system/cachefs-peers)")
    g.add_argument("--serve", dest="cluster_serve",
                   help="datasets this node fetches for the group: * (default: any the group reads), URL prefixes "
                        "separated by commas, or none (only datasets a reader on this node opened)")
    g.add_argument("--secret-file", dest="cluster_secret_file",
                   help="a secret shared by the group instead of ServiceAccount tokens (one host, tests)")
    g.add_argument("--token-file", dest="cluster_token_file", help="this node's projected ServiceAccount token")
    g.add_argument("--tls-cert", dest="cluster_tls_cert", help="TLS between members: the group's certificate (PEM)")
    g.add_argument("--tls-key", dest="cluster_tls_key", help="its private key (PEM)")
    g.add_argument("--tls-ca", dest="cluster_tls_ca", help="the CA that signed it (PEM)")
    ag.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster, then $KUBECONFIG)")
    ag.add_argument("--metrics-listen", metavar="HOST:PORT", help="serve the node's metrics here")
    ag.add_argument("--ready-file", help=argparse.SUPPRESS)  # internal (tests): written once membership is known
    for name, cmd in (("prefetch", pf), ("pack", pk), ("status", st), ("pin", pn), ("evict", ev), ("order", od),
                      ("refresh", rf),
                      ("mount", mt), ("umount", um), ("demo", dm), ("metrics", mx), ("agent", ag)):
        module = "mounting" if name in ("mount", "umount") else "commands"
        cmd.set_defaults(run=f"cachefs.cli.{module}:{name}", node_process=name in ("mount", "metrics", "agent"))
    for name, cmd in (("sync", sy), ("checkpoints", ck)):
        cmd.set_defaults(run=f"cachefs.cli.volumes:{name}", node_process=name == "sync")
    # Commands of the other packages (csi, scheduler_hints) register themselves: cachefs imports neither.
    groups = {"base": base, "cache": cache, "capacity": capacity, "origin": origin}
    for ep in entry_points(group="cachefs.commands"):
        ep.load()(sub, groups)
    return p


def _config(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {
        "cache_dir": getattr(args, "cache_dir", None),
        "cache_capacity": getattr(args, "capacity", None),
        "engine_memory_budget": getattr(args, "memory_budget", None),
        "origin_endpoint_url": getattr(args, "endpoint_url", None),
        "origin_region": getattr(args, "region", None),
        "origin_profile": getattr(args, "profile", None),
    }
    for key, value in vars(args).items():
        if key.startswith("cluster_"):
            overrides[key] = value
    return load_config(getattr(args, "config", None), overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose < 2:
        for noisy in ("botocore", "aiobotocore", "s3fs", "urllib3"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        config = _config(args)
        command = args.run.partition(":")[2]
        config = cache_for(command, getattr(args, TARGETS.get(command, ""), None), config,
                           explicit=told(getattr(args, "cache_dir", None), config))
    except (CacheFSError, OSError) as exc:
        return _fail(exc)
    if getattr(args, "node_process", False):
        _metrics_dir(config)  # before anything imports prometheus-client
    if command == "mount":  # the process a mount starts next begins before this one imports the rest
        from cachefs.cli.mount_setup import start_early

        args.started_early = start_early(args, config)
    module, _, name = args.run.partition(":")
    handler = getattr(importlib.import_module(module), name)
    quiet_collector()  # after the imports: what they made is never walked again
    try:
        return asyncio.run(handler(args, config))
    except KeyboardInterrupt:
        print("cachefs: interrupted; everything cached so far is kept, run the same command to resume",
              file=sys.stderr)
        return 130
    except (CacheFSError, OSError) as exc:
        return _fail(exc)


def _fail(exc: BaseException) -> int:
    print(f"cachefs: error: {exc}", file=sys.stderr)
    return next((c for cls, c in EXIT_CODES if isinstance(exc, cls)), 1)


def _metrics_dir(config: Config) -> None:
    """Have this long-lived node process (and the processes it starts) write its metrics where the node's endpoint
    reads them (docs/METRICS.md); without a usable directory each process keeps its metrics to itself. Short
    commands (status, prefetch) do not: each would leave a file behind."""
    import os

    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or config.metrics.dir
    if not d:
        return
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except OSError as exc:
        logging.getLogger("cachefs").info("metrics stay in this process: %s: %s", d, exc.strerror)
        return
    if not os.access(d, os.W_OK | os.X_OK):  # (another user's: a metric must never stop this process)
        logging.getLogger("cachefs").info("metrics stay in this process: %s is not writable", d)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        return
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = d


if __name__ == "__main__":
    sys.exit(main())

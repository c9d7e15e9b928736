"""The CLI's subcommands; each takes the parsed arguments and the loaded config and returns an exit code."""

from __future__ import annotations

import argparse
import sys

from cachefs.base.config import Config
from cachefs.base.errors import CacheFSError, ConfigError, ObjectNotFoundError
from cachefs.base.types import DatasetRef
from cachefs.base.values import human_bytes
from cachefs.cli.output import print_json
from cachefs.cli.progress import ProgressPrinter
from cachefs.engine import Engine
from cachefs.jobs import select_files, warm
from cachefs.prefetch.publish import publish_order
from cachefs.status.summary import NodeSummary, status_report

__all__ = ["demo", "evict", "metrics", "order", "pack", "pin", "prefetch", "refresh", "status"]


async def prefetch(args: argparse.Namespace, config: Config) -> int:
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    engine = Engine(config)
    try:
        if args.refresh:
            await engine.refresh(args.url)
        ds = await engine.open_dataset(args.url, manifest_version=args.manifest_version)
        if (args.include or args.exclude) and next(select_files(ds.walk_files(), args.include, args.exclude),
                                                   None) is None:
            said = " ".join([*(f"--include {g}" for g in args.include or ()),
                             *(f"--exclude {g}" for g in args.exclude or ())])
            raise ObjectNotFoundError(f"{ds.ref.url}: nothing matched {said} (paths are relative to the dataset, "
                                      "e.g. train/*.jpg)")
        printer = ProgressPrinter(quiet=args.quiet or args.json)
        prog = await warm(engine, ds, include=args.include, exclude=args.exclude, workers=args.workers,
                          on_progress=printer)
        printer.finish(prog)
    finally:
        await engine.aclose()
    if args.json:
        print_json({"url": ds.ref.url, "manifest_version": ds.version, "files_total": prog.files_total,
                    "files_done": prog.files_done, "bytes_total": prog.bytes_total, "bytes_done": prog.bytes_done,
                    "bytes_fetched": prog.bytes_fetched, "bytes_skipped": prog.bytes_skipped,
                    "seconds": round(prog.elapsed, 3), "failed": [{"path": p, "error": e} for p, e in prog.failed]})
    else:
        print(f"{ds.ref.url}: {prog.files_done}/{prog.files_total} files, {human_bytes(prog.bytes_done)} cached "
              f"({human_bytes(prog.bytes_fetched)} fetched, {human_bytes(prog.bytes_skipped)} already cached) "
              f"in {prog.elapsed:.1f}s, {human_bytes(prog.rate)}/s")
    for path, why in prog.failed[:20]:
        print(f"  failed: {path}: {why}", file=sys.stderr)
    if prog.failed:
        print(f"cachefs: error: {len(prog.failed)} file(s) could not be cached", file=sys.stderr)
        return 1
    return 0


async def status(args: argparse.Namespace, config: Config) -> int:
    from cachefs.cli.which_cache import other_caches, told

    rep = status_report(config)
    others = [] if told(args.cache_dir, config) else other_caches(config)
    if args.json:
        print_json({**rep, "other_caches": others})
        return 0
    print(f"cache dir  {rep['cache_dir']}")
    if others:
        print(f"           other caches on this node: {', '.join(others)} (cachefs status --cache-dir DIR)")
    limited = (f" (capacity {human_bytes(rep['capacity_bytes'])}: the disk runs out first)"
               if rep["usable_bytes"] < rep["capacity_bytes"] else "")
    print(f"used       {human_bytes(rep['used_bytes'])} of {human_bytes(rep['usable_bytes'])} usable{limited} "
          f"in {rep['objects']} objects; disk free {human_bytes(rep['disk_free_bytes'])}")
    for m in rep["mounts"]:
        if m.get("state") == "failing":
            print(f"mount      {m['mountpoint']}  {m['url']}  FAILING: {m.get('reason') or 'see the mount log'}  "
                  f"holder pid {m.get('holder_pid')}")
            continue
        opens = ", opens skipped" if m.get("opens_skipped") else ""
        if (m.get("stats") or {}).get("io_uring_queues"):
            opens += f", io_uring ({m['stats']['io_uring_queues']} queues)"
        serving = f"mode {m['mode']}{opens}  pid {m['pid']}" if m.get("pid") else m.get("state", "starting")
        print(f"mount      {m['mountpoint']}  {m['url']}  {serving}")
        if m.get("mirror_problem"):
            print(f"           its packed mirror cannot be used ({m['mirror_problem']}): small files are read one "
                  "GET each; `cachefs pack` writes it again")
    for mnt, why in rep.get("left_with_previous_generation", {}).items():
        print(f"mount      {mnt}  NOT TAKEN OVER by this node pod: {why}")
    for v in rep.get("volumes", []):
        if v.get("done"):
            print(f"volume     {v.get('mountpoint') or v['url']}  {v['url']}  done: everything closed there is on "
                  "the origin")
            continue
        print(f"volume     {v.get('mountpoint') or v['url']}  {v['url']}  "
              + (f"owner pid {v.get('pid')}" if v["owner_alive"] else "NO OWNER: cachefs sync resumes its uploads"))
        print(f"           staged {human_bytes(v.get('staged_bytes', 0))} in {v.get('staged_files', 0)} closed files "
              f"(limit {human_bytes(v.get('staging_limit', 0))}); not yet closed {human_bytes(v.get('below_promise_bytes', 0))}; "
              f"oldest {v.get('oldest_staged_age', 0):.0f}s; uploaded {human_bytes(v.get('uploaded_bytes', 0))} "
              f"at {human_bytes(v.get('upload_rate', 0))}/s; {v.get('durability', '')}")
        if v.get("last_error"):
            print(f"           upload failing ({v.get('failures', 0)} failures): {v['last_error']}")
        for seq, reason in (v.get("failed") or {}).items():
            print(f"           FAILED for good (entry {seq}): {reason}")
    corrupt = sum(rep.get("corrupt_reads", {}).values())
    if corrupt:
        print(f"disk       {corrupt} cached block(s) or file(s) failed their checksum and were fetched again "
              "(see the logs: is the cache disk healthy?)")
    for li in rep.get("listings", ()):
        print(f"listing    {li['url']}: {li['files']:,} files ({human_bytes(li['bytes'])}) so far, "
              f"{li['files_per_second']:,} files/s")
    if not rep["datasets"]:
        print("no datasets cached")
        return 0
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    rows = [("DATASET", "ID", "MANIFEST", "FILES", "SIZE", "CACHED", "HIT RATIO", "POLICY", "EPOCH HITS (NOW/LAST)")]
    for d in rep["datasets"]:
        epochs = "-" if d["policy"] == "lru" else f"{pct(d['epoch_hit_ratio'])}/{pct(d['last_epoch_hit_ratio'])}"
        policy = ("pin," if d.get("pinned_by") else "") + d["policy"] + (
            f"+ordered({len(d['orders'])})" if d["orders"] else "")
        rows.append((d["url"], d["id"], f"v{d['manifest_version']}", str(d["files"]), human_bytes(d["total_bytes"]),
                     f"{100 * d['cached_fraction']:.1f}%", pct(d["hit_ratio"]), policy, epochs))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for d in rep["datasets"]:
        if d.get("old_version_bytes"):
            print(f"{d['url']}: {human_bytes(d['old_version_bytes'])} more cached of earlier manifests (versions changed "
                  "or deleted at the origin since; readers that started before the refresh still read them)")
    return 0


async def pin(args: argparse.Namespace, config: Config) -> int:
    from cachefs.index.hints import HintStore

    NodeSummary(config)  # a cache directory that does not exist is an error, not one to create
    ref = DatasetRef.from_url(args.url)
    engine = Engine(config)
    try:
        hints = HintStore(engine.index)
        (hints.unpin if args.remove else hints.pin)(ref.id)
        others = [s for s in hints.pins().get(ref.id, []) if s != "cli"]
    finally:
        await engine.aclose()
    if args.remove:
        print(f"{ref.url}: no longer pinned here" + (f" (still pinned by {', '.join(others)})" if others else ""))
    else:
        print(f"{ref.url}: pinned on this node: eviction passes over what is cached of it (cachefs evict still "
              "removes it; cachefs pin --remove undoes this)")
    return 0


async def evict(args: argparse.Namespace, config: Config) -> int:
    if not args.url and not args.all:
        raise ConfigError("give a dataset URL or --all")
    if args.group and not args.url:
        raise ConfigError("--group evicts one dataset across the group: give its URL")
    NodeSummary(config)  # a cache directory that does not exist is an error, not one to create
    engine = Engine(config)
    try:
        if args.all:
            freed = engine.purge_sync()
        else:
            ref = DatasetRef.from_url(args.url)
            if engine.dataset_record(ref.id) is None and not args.group:
                raise ObjectNotFoundError(f"{ref.url}: not in this cache (nothing of it was cached in "
                                          f"{config.cache.dir}; cachefs status lists what is)")
            freed = engine.purge_sync(ref.id)
        total = NodeSummary(config).report()["used_bytes"]
        members = await engine.group.evict_everywhere(ref) if args.group else {}
    finally:
        await engine.aclose()
    print(f"evicted {human_bytes(freed)}; {human_bytes(total)} still cached (objects in use are kept)")
    if args.group:
        if not members:
            raise ConfigError("this node is in no cache group (no agent serves this cache directory): evicted here "
                              "only")
        for name, got in members.items():
            what = ("does not know the dataset" if got is None else
                    f"evicted {human_bytes(got)}" if isinstance(got, int) else f"not evicted: {got}")
            print(f"  {name}: {what}")
        if any(isinstance(got, str) for got in members.values()):
            raise CacheFSError("some members could not be asked; run it again once they are back")
    return 0


async def order(args: argparse.Namespace, config: Config) -> int:
    if args.epoch is not None and args.epoch < 0:
        raise ConfigError(f"--epoch {args.epoch}: epochs count from 0")
    if args.sampler:
        return await _sampler_orders(args, config)
    try:
        f = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{args.file}: {exc.strerror}") from None
    with f:
        try:
            paths = [line.rstrip("\n") for line in f if line.strip()]
        except UnicodeDecodeError:
            raise ConfigError(f"{args.file}: not UTF-8 text (one path a line)") from None
    written = publish_order(args.dataset, paths, epoch=args.epoch, cache_dir=config.cache.dir,
                            publisher=args.publisher)
    unknown = _unknown_paths(config, args.dataset, paths) if "://" in args.dataset else None
    said = "" if unknown is None or not unknown[0] else \
        f"; {unknown[0]} of them are not files of the dataset's manifest v{unknown[1]} (first: {unknown[2]}): never fetched"
    print(f"published an order of {len(paths)} files ({written}){said}")
    return 0


def _unknown_paths(config: Config, url: str, paths: list[str]) -> tuple[int, int, str] | None:
    """How many of ``paths`` the dataset's newest manifest on this node lacks, its version and the first of them;
    None when this cache does not know the dataset (nothing to check against). Reads the index only."""
    from cachefs.index import Index
    from cachefs.index.caches import is_cache
    from cachefs.manifest import ManifestStore
    from cachefs.prefetch.orders import relative_paths

    if not is_cache(config.cache.dir):
        return None
    index = Index(config.cache.dir)
    ref = DatasetRef.from_url(url)
    rec = index.dataset(ref.id)
    if rec is None or not rec.manifests:
        return None
    store, version = ManifestStore(index), max(m.version for m in rec.manifests)
    missing = []
    for path in relative_paths(paths, [ref.url]):
        try:
            store.lookup(ref.id, version, path)
        except ObjectNotFoundError:
            missing.append(path)
    return len(missing), version, missing[0] if missing else ""


async def _sampler_orders(args: argparse.Namespace, config: Config) -> int:
    import os

    from cachefs.prefetch.samplers import parse_sampler, sampler_files, sampler_orders

    spec = parse_sampler(args.sampler)
    if "://" in args.dataset:
        engine = Engine(config)
        try:
            ds = await engine.open_dataset(args.dataset)
            paths = [e.path for e in ds.walk_files()]
        finally:
            await engine.aclose()
    else:  # a mount point: its tree (the mount lists it from the manifest)
        root = os.path.abspath(args.dataset)
        paths = [os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files]
    files = sampler_files(paths, spec, args.dataset)
    epoch = spec.start_epoch if args.epoch is None else args.epoch
    for rank, ordered in sampler_orders(files, spec, epoch).items():
        publish_order(args.dataset, ordered, epoch=epoch, cache_dir=config.cache.dir, publisher=spec.publisher(rank))
    print(f"published epoch {epoch}'s orders of {len(spec.ranks)} rank(s), {len(files)} files in all")
    return 0


async def refresh(args: argparse.Namespace, config: Config) -> int:
    engine = Engine(config)
    try:
        rec = await engine.refresh(args.url)
    finally:
        await engine.aclose()
    m = rec.manifest()
    if m is None:  # (a snapshot just taken is the dataset's current manifest)
        raise CacheFSError(f"{rec.url}: no current manifest after the refresh")
    print(f"{rec.url}: manifest v{m.version}: {m.files} files, {human_bytes(m.bytes)}"
          + (f", {m.skipped} names skipped (see -v)" if m.skipped else ""))
    return 0


async def demo(args: argparse.Namespace, config: Config) -> int:
    from cachefs.cli.demo import run_demo

    return await run_demo(args, config)


async def pack(args: argparse.Namespace, config: Config) -> int:
    from cachefs.formats.mirror_index import mirror_url_for
    from cachefs.jobs import write_mirror

    to = args.to or mirror_url_for(args.url)
    if to.rstrip("/") == args.url.rstrip("/") or to.startswith(args.url.rstrip("/") + "/"):
        raise ConfigError(f"--to {to}: the mirror must not lie inside the dataset it mirrors")
    engine = Engine(config)
    try:
        if args.refresh:
            await engine.refresh(args.url)
        ds = await engine.open_dataset(args.url)

        def progress(s) -> None:
            if not args.json:
                print(f"\r{s.files} files, {human_bytes(s.bytes)} in {s.packs} packs", end="", file=sys.stderr,
                      flush=True)

        summary = await write_mirror(engine, ds, to, on_progress=progress)
    finally:
        await engine.aclose()
    if args.json:
        print_json({"url": ds.ref.url, "mirror": summary.url, "manifest_version": ds.version, "files": summary.files,
                    "bytes": summary.bytes, "packs": summary.packs, "skipped_large_files": summary.skipped_large,
                    "verified": summary.verified, "seconds": round(summary.seconds, 3)})
    else:
        print(f"\n{ds.ref.url}: {summary.files} small files ({human_bytes(summary.bytes)}) packed into "
              f"{summary.packs} packs at {summary.url} in {summary.seconds:.1f}s, verified against manifest "
              f"{ds.version}; {summary.skipped_large} larger files are read from the source as they are")
    return 0


async def metrics(args: argparse.Namespace, config: Config) -> int:
    import asyncio

    from cachefs.base.config import parse_listen
    from cachefs.status.server import serve_metrics

    host, port = parse_listen(args.listen, "--listen")
    serve_metrics(config, host, port)
    print(f"serving metrics on http://{args.listen}/metrics (from {config.metrics.dir or 'this process only'})",
          file=sys.stderr)
    await asyncio.Event().wait()  # until stopped (SIGTERM, SIGINT)
    return 0


async def agent(args: argparse.Namespace, config: Config) -> int:
    from cachefs.agent import run_agent

    return await run_agent(config, kubeconfig=args.kubeconfig, metrics_listen=args.metrics_listen,
                           ready_file=args.ready_file)

"""The commands of writable checkpoint volumes: ``cachefs mount --writable``, ``cachefs sync``, ``cachefs
checkpoints``, and the drain ``cachefs umount`` does first."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from cachefs.base.config import Config
from cachefs.base.errors import CacheFSError, ConfigError
from cachefs.base.types import canonical_url, within
from cachefs.index.volumes import journal_last_seq, owner_alive, read_status, volume_dirs, wait_for_owner

__all__ = ["checkpoints", "drain_mount", "mount_writable", "sync"]


async def mount_writable(args: argparse.Namespace, config: Config, mnt: str) -> int:
    from cachefs.cli.mount_setup import check_mountpoint, daemon_argv, mount_log_path
    from cachefs.fuse import hold_mount, serve_writable_mount
    from cachefs.fuse.holder_process import start_holder

    if args.sampler or args.mode:
        raise ConfigError("--sampler and --mode are for dataset mounts, not --writable ones")
    if args.attach:  # the serving daemon, started (and restarted) by the holder below
        from cachefs.base.values import parse_group

        await asyncio.to_thread(serve_writable_mount, config, args.url, mnt, attach=args.attach, workers=args.workers,
                                group=parse_group(args.group) if args.group else None, shared=args.allow_other)
        return 0
    argv = daemon_argv(args, config, mnt)
    if args.adopt:  # a holder for a mount whose holder died (the session keeper's copy): mounted and checked
        return hold_mount(config, args.url, mnt, argv, answer_after=args.answer_after, allow_other=args.allow_other,
                          nonempty=args.nonempty, writable=True, adopt=True)
    await asyncio.to_thread(check_mountpoint, config, mnt, args.nonempty)
    await _check_volume_url(config, args.url)  # (one line now, rather than a daemon that cannot start)
    if args.foreground:
        return hold_mount(config, args.url, mnt, argv, answer_after=args.answer_after, allow_other=args.allow_other,
                          nonempty=args.nonempty, writable=True)
    log_path = mount_log_path(config, mnt)
    proc = await asyncio.to_thread(start_holder, argv, mnt, log_path, cache_dir=config.cache.dir)
    print(f"mounted {args.url} writable at {mnt} (pid {proc.pid}, log {log_path})")
    return 0


async def _check_volume_url(config: Config, url: str) -> None:
    from cachefs.sources import open_object_writes, open_origin

    await open_object_writes(url, config).close()  # (refuses a scheme that cannot take checkpoints)
    source = open_origin(url, config)
    try:
        async for _batch in source.list_tree(url):
            break
    finally:
        await source.close()


# -- sync ---------------------------------------------------------------------------------------------------------
def _volumes_for(config: Config, target: str | None) -> list[tuple[str, dict[str, Any]]]:
    """The volumes ``target`` names: a writable mount point (or a directory in one), or a URL at or under a
    volume's root (or above several: all of them). An empty list for a URL no volume holds now."""
    vols = volume_dirs(config.cache.dir)
    if target is None:
        return vols
    if "://" in target:
        url = canonical_url(target).rstrip("/")
        return [(d, i) for d, i in vols if within(url, i.get("url", "")) or within(i.get("url", ""), url)]
    path = os.path.abspath(target)
    found = [(d, i) for d, i in vols if within(path, i.get("mountpoint", ""))]
    if not found:
        raise ConfigError(f"{target}: no writable volume of this node's cache ({config.cache.dir}) is there")
    return found



async def _drain(config: Config, vdir: str, info: dict[str, Any], deadline: float | None) -> tuple[bool, list[str]]:
    """Wait until every entry the volume's journal holds now has left its queue; (done, what is pending). A volume
    without a live owner is taken over and drained here."""
    target = journal_last_seq(vdir)
    if owner_alive(vdir):
        done, pending = await asyncio.to_thread(wait_for_owner, vdir, target, deadline)
        if done or owner_alive(vdir):
            return done, pending
    from cachefs.write.opening import open_volume

    extra = {k: v for k, v in info.items() if k not in ("url", "session")}
    try:
        volume = open_volume(config, info["url"], session=info["session"], **extra)
    except ConfigError:  # its owner came back meanwhile
        return await _drain(config, vdir, info, deadline)
    await volume.start(list_origin=False)
    try:
        while not volume.queue.done_through(target):
            if deadline is not None and time.monotonic() > deadline:
                return False, list(volume.status()["pending"])
            await asyncio.sleep(0.1)
        return True, []
    finally:
        await volume.stop()


async def sync(args: argparse.Namespace, config: Config) -> int:
    if args.timeout is not None and args.timeout < 0:
        raise ConfigError(f"--timeout {args.timeout:g}: must not be negative")
    volumes = _volumes_for(config, args.target)
    if not volumes:
        print(f"nothing pending: no writable volume of this node's cache ({config.cache.dir}) holds "
              f"{args.target or 'anything'}")
        return 0
    if args.commit:
        if args.target is None or "://" in args.target or not os.path.isdir(args.target):
            raise ConfigError("--commit takes a directory in a writable mount")
        from cachefs.fuse.writable import COMMIT_XATTR

        os.setxattr(args.target, COMMIT_XATTR, b"1")
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    pending: list[str] = []
    failed: list[str] = []
    for vdir, info in volumes:
        since = journal_last_seq(vdir)
        _done, left = await _drain(config, vdir, info, deadline)
        pending += [f"{info['url']}: {p}" for p in left]
        for seq, reason in (read_status(vdir).get("failed") or {}).items():
            if int(seq) <= since:
                failed.append(f"{info['url']}: {reason}")
    for line in failed:
        print(f"cachefs: failed for good: {line}", file=sys.stderr)
    if pending:
        print(f"cachefs: not on the origin yet ({len(pending)} shown):", file=sys.stderr)
        for line in pending:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 1 if failed else 0


async def drain_mount(config: Config, mnt: str, timeout: float) -> None:
    """Before a writable mount is unmounted: wait (up to ``timeout``) for its uploads."""
    for vdir, info in volume_dirs(config.cache.dir):
        if info.get("mountpoint") == mnt:
            done, left = await _drain(config, vdir, info, time.monotonic() + timeout)
            if not done:
                print(f"cachefs: {mnt}: {len(left)} queue entries are not on the origin yet; they stay on this "
                      f"node and resume at the next mount of {info['url']} here or with cachefs sync",
                      file=sys.stderr)


# -- checkpoints --------------------------------------------------------------------------------------------------
async def checkpoints(args: argparse.Namespace, config: Config) -> int:
    from cachefs.sources import open_origin
    from cachefs.write.commits import list_commits

    url = canonical_url(args.url).rstrip("/")
    source = open_origin(url, config)
    try:
        records = await list_commits(source, url)
    except CacheFSError:
        raise
    finally:
        await source.close()
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    if not records:
        print(f"no committed checkpoints under {url}")
        return 0
    for r in records:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("committed", 0)))
        print(f"{r.get('name', '?'):<40} {len(r.get('files', [])):>6} files {r.get('bytes', 0):>16,} bytes  {when}")
    return 0

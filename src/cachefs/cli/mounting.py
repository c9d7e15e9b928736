"""``cachefs mount`` and ``cachefs umount``. Apart from the other commands, and importing the engine only where it
runs (a holder's check, the daemon), so that the processes a mount starts begin before this one has imported much
(see :func:`~cachefs.cli.mount_setup.start_early`)."""

from __future__ import annotations

import argparse

from cachefs.base.config import Config
from cachefs.base.errors import ConfigError
from cachefs.base.values import ReadAccess, parse_group, parse_read_mode
from cachefs.cli.mount_setup import check_mountpoint, mount_log_path

__all__ = ["mount", "umount"]


async def mount(args: argparse.Namespace, config: Config) -> int:
    import asyncio
    import os

    from cachefs.base.early_start import EarlyChild, wait_for_go
    from cachefs.cli.mount_setup import daemon_argv, start_early
    from cachefs.fuse.holder_process import start_holder

    mnt = os.path.abspath(args.mountpoint)
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    if not args.answer_after >= 0:
        raise ConfigError("--answer-after must be 0 or more seconds")
    if args.writable:
        from cachefs.cli.volumes import mount_writable

        return await mount_writable(args, config, mnt)
    access = _read_access(args)
    sampler = None
    if args.sampler:
        from cachefs.prefetch.samplers import parse_sampler

        sampler = parse_sampler(args.sampler)
    if args.attach:  # the serving daemon, started (and restarted) by the holder below
        from cachefs.fuse import serve_mount
        from cachefs.fuse.uring import uring_enabled

        if not await asyncio.to_thread(wait_for_go):
            return 0  # (started early as the first daemon; the holder's check failed: not needed)
        await asyncio.to_thread(serve_mount, config, args.url, mnt, attach=args.attach, workers=args.workers,
                                passthrough=not args.no_passthrough, prefill=not args.no_prefill,
                                skip_opens=not args.keep_opens, io_uring=args.io_uring == "auto" and uring_enabled(),
                                access=access, sampler=sampler)
        return 0
    argv = daemon_argv(args, config, mnt)
    if args.adopt or args.foreground:
        from cachefs.fuse import hold_mount
    # (cli.main started it before importing this module: a holder's first daemon, or the background's holder)
    early = getattr(args, "started_early", None) or start_early(args, config)
    if args.adopt:  # a holder for a mount whose holder died (the session keeper's copy): mounted and checked
        assert isinstance(early, EarlyChild)
        return hold_mount(config, args.url, mnt, argv, answer_after=args.answer_after, allow_other=args.allow_other,
                          nonempty=args.nonempty, adopt=True, first=early)
    if args.foreground:  # this process holds the mount; the daemon serving it is its child
        # The first daemon imports what it serves with (half a second of Python) while this process checks; it
        # attaches once the mount is there, or exits if it never comes.
        first = early
        assert isinstance(first, EarlyChild)
        try:
            await _check_mount(args, config, mnt, sampler)
        except BaseException:
            first.cancel()
            raise
        return hold_mount(config, args.url, mnt, argv, answer_after=args.answer_after, allow_other=args.allow_other,
                          nonempty=args.nonempty, first=first)
    # Background: the same command in the foreground, in its own session (it checks, and its error is ours);
    # return once it serves.
    assert early is not None and not isinstance(early, EarlyChild)
    try:  # (here too, before waiting: a live mount there would look like ours served)
        await asyncio.to_thread(check_mountpoint, config, mnt, args.nonempty)
    except BaseException:
        early.terminate()
        early.wait()
        raise
    log_path = mount_log_path(config, mnt)
    proc = await asyncio.to_thread(start_holder, argv, mnt, log_path, cache_dir=config.cache.dir, started=early)
    print(f"mounted {args.url} at {mnt} (pid {proc.pid}, log {log_path})")
    return 0


async def _check_mount(args: argparse.Namespace, config: Config, mnt: str, sampler) -> None:
    """The mount point is free and the dataset opens (credentials, bucket, a manifest on this node) before anything
    is mounted, so a typo is one line and an exit code, never a mount that hangs."""
    import asyncio

    await asyncio.to_thread(check_mountpoint, config, mnt, args.nonempty)
    from cachefs.engine import Engine

    engine = Engine(config)
    try:
        # (with no manifest here yet: one listing of the root, as the daemon will serve the tree while it lists)
        ds = await engine.open_dataset(args.url, lazy=sampler is None)
        if sampler is not None:  # (one line now, rather than a daemon that cannot start)
            from cachefs.prefetch.samplers import sampler_files

            sampler_files((e.path for e in ds.walk_files()), sampler, args.url)
    finally:
        await engine.aclose()


def _read_access(args: argparse.Namespace) -> ReadAccess:
    """Who may read the mount's files (``--group``, ``--mode``): owned by this user."""
    import os

    gid = parse_group(args.group) if args.group else os.getegid()
    mode = parse_read_mode(args.mode) if args.mode else (0o440 if args.group else 0o444)
    return ReadAccess(os.geteuid(), gid, mode)


async def umount(args: argparse.Namespace, config: Config) -> int:
    import os

    from cachefs.fuse.mount import is_fuse_mount, unmount

    mnt = os.path.abspath(args.mountpoint)
    if not is_fuse_mount(mnt):
        raise ConfigError(f"{args.mountpoint}: not a cachefs mount")
    if not args.no_sync:
        from cachefs.cli.volumes import drain_mount

        if args.timeout < 0:
            raise ConfigError(f"--timeout {args.timeout:g}: must not be negative")
        await drain_mount(config, mnt, args.timeout)
    unmount(mnt)
    return 0

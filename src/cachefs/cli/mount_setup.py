"""What starting a mount needs, whichever kind: the mount point checked, the options handed to the processes it
starts, and where it logs."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cachefs.base.config import Config
from cachefs.base.errors import ConfigError

if TYPE_CHECKING:
    import subprocess

    from cachefs.base.early_start import EarlyChild

__all__ = ["check_mountpoint", "daemon_argv", "mount_log_path", "mount_options", "start_early"]


def mount_log_path(config: Config, mountpoint: str) -> str:
    """Where a background mount logs: in the log directory, off the cache disk (a full cache disk would
    silence it)."""
    import os

    from cachefs.index.mounts import mount_file

    return os.path.join(config.cache.log_dir, os.path.basename(mount_file("", mountpoint, ".log")))


def check_mountpoint(config: Config, mnt: str, nonempty: bool = False) -> None:
    """An existing directory that no live cachefs mount occupies; never waits on a hung mount."""
    import os

    from cachefs.fuse.mount import is_fuse_mount, probe_mount
    from cachefs.index.mounts import holder_state

    if is_fuse_mount(mnt):
        held = holder_state(config.cache.dir, mnt)
        if held is not None:
            raise ConfigError(f"{mnt} is already a cachefs mount ({held['state']}, holder pid {held['holder_pid']}); "
                              "cachefs umount it first")
        state = probe_mount(mnt)
        if state == "serving":
            raise ConfigError(f"{mnt} is already a cachefs mount (cachefs umount it first)")
        if state == "hung":
            raise ConfigError(f"{mnt} is a cachefs mount that does not answer; cachefs umount it first")
        return  # stale: the holder cleans it up
    if not os.path.lexists(mnt):
        raise ConfigError(f"mount point {mnt} does not exist")
    if not os.path.isdir(mnt):
        raise ConfigError(f"mount point {mnt} is not a directory")
    if not nonempty:
        from cachefs.fuse.holder_process import check_empty

        check_empty(mnt)


def mount_options(args: argparse.Namespace, config: Config) -> list[str]:
    """The options of this ``cachefs mount`` for the processes it starts (same cache, config and origin)."""
    out = ["--workers", str(args.workers), "--cache-dir", config.cache.dir, "--answer-after", str(args.answer_after)]
    for flag, value in (("--config", args.config), ("--capacity", args.capacity),
                        ("--memory-budget", args.memory_budget), ("--endpoint-url", args.endpoint_url),
                        ("--region", args.region), ("--profile", args.profile)):
        if value:
            out += [flag, value]
    out += [f"--{name.replace('_', '-')}" for name in ("no_passthrough", "no_prefill", "keep_opens", "allow_other",
                                                       "nonempty", "writable") if getattr(args, name)]
    for flag, value in (("--group", args.group), ("--mode", args.mode), ("--sampler", args.sampler),
                        ("--io-uring", getattr(args, "io_uring", None))):
        if value:
            out += [flag, value]
    if args.verbose:
        out.append("-" + "v" * args.verbose)
    return out


def daemon_argv(args: argparse.Namespace, config: Config, mountpoint: str) -> list[str]:
    """The command of a mount's holder, and of its daemons (with ``--attach``)."""
    import sys

    return [sys.executable, "-m", "cachefs.cli.main", "mount", args.url, mountpoint, "--foreground",
            *mount_options(args, config)]


def start_early(args: argparse.Namespace, config: Config) -> EarlyChild | subprocess.Popen | None:
    """What a ``cachefs mount`` of a dataset starts before this process imports the rest of what it runs (about
    0.3 s of Python), so that the process it starts imports meanwhile: in the background, the holder (which checks
    and mounts; its error is the command's); as a holder (``--foreground``, or ``--adopt``: the next node pod
    generation's, whose readers wait from the previous holder's retiring until this daemon serves), its first
    daemon, which attaches once the holder listens (or exits if the holder gives up first). None for every other
    kind of mount."""
    import os

    from cachefs.base.early_start import EarlyChild, start_detached
    from cachefs.index.mounts import holder_socket

    if args.attach or args.writable:
        return None
    mnt = os.path.abspath(args.mountpoint)
    argv = daemon_argv(args, config, mnt)
    if not args.foreground and not args.adopt:
        return start_detached(argv, mount_log_path(config, mnt))
    return EarlyChild([*argv, "--attach", holder_socket(config.cache.dir, mnt)])

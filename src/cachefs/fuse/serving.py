"""Holding a mount (:func:`hold_mount`: mount, keep the ``/dev/fuse`` descriptor, run and restart the daemon) and
serving it (:func:`serve_mount`: the daemon, which serves until unmounted and can be killed and restarted at any
time)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys

from cachefs.base.aio import run_soon, run_sync
from cachefs.base.collector import quiet_collector
from cachefs.base.config import Config
from cachefs.base.early_start import EarlyChild
from cachefs.base.values import ReadAccess
from cachefs.engine import get_engine
from cachefs.fuse.backing import DeviceBacking
from cachefs.fuse.fs import CacheFS
from cachefs.fuse.handover import announce_failure, announce_ready, receive_fd
from cachefs.fuse.holder import MountHolder
from cachefs.fuse.inode_table import InodeTable
from cachefs.fuse.journal import MountJournal
from cachefs.fuse.keeper import KEEPER_ENV, PREDECESSOR_ENV
from cachefs.fuse.mount import is_fuse_mount
from cachefs.fuse.session import FuseSession
from cachefs.index.mounts import forget_mount, holder_socket, mount_file, record_mount, record_pin
from cachefs.manifest.lazy import is_provisional
from cachefs.prefetch.samplers import SamplerPublisher, SamplerSpec, sampler_files

__all__ = ["hold_mount", "serve_mount"]

log = logging.getLogger("cachefs.fuse")


def hold_mount(config: Config, url: str, mountpoint: str, daemon_argv: list[str], *, answer_after: float = 10.0,
               allow_other: bool = False, nonempty: bool = False, writable: bool = False, adopt: bool = False,
               first: EarlyChild | None = None) -> int:
    """Mount ``mountpoint`` and keep it mounted until unmounted, serving it by running ``daemon_argv`` (plus
    ``--attach SOCKET``) and restarting that daemon whenever it dies: readers wait, they never see ENOTCONN
    (unless no daemon can start for a while; see :mod:`.holder`). Only the mounting user may read it unless
    ``allow_other``. With a session keeper (``$CACHEFS_SESSION_KEEPER``) the descriptor is kept there too, and
    ``adopt`` holds a mount whose holder died on the keeper's copy instead of mounting (``daemon_argv`` is also
    the holder's own command, which the keeper's copy carries for the next one). ``first``: the first daemon,
    started early (``daemon_argv --attach`` the holder's socket), waiting to attach."""
    holder = MountHolder(mountpoint, holder_socket(config.cache.dir, mountpoint), url=url,
                         cache_dir=config.cache.dir, answer_after=answer_after, allow_other=allow_other,
                         nonempty=nonempty, writable=writable, keeper=os.environ.get(KEEPER_ENV, ""),
                         restart_argv=daemon_argv)
    try:
        if adopt:  # (from the previous node pod generation's keeper when the mounter names one)
            holder.adopt(os.environ.pop(PREDECESSOR_ENV, ""))
        else:
            holder.mount()
    except BaseException:
        if first is not None:
            first.cancel()
        raise
    rc = holder.run([*daemon_argv, "--attach", holder.socket_path], first=first)
    return 0 if holder.retired else rc


def serve_mount(config: Config, url: str, mountpoint: str, *, attach: str, workers: int = 4,
                passthrough: bool = True, prefill: bool = True, skip_opens: bool = True, io_uring: bool = False,
                access: ReadAccess | None = None, ready=None, sampler: SamplerSpec | None = None) -> FuseSession:
    """Serve ``url`` on the mount whose descriptor the holder at socket ``attach`` owns, until unmounted.
    The first daemon of a mount answers the kernel's INIT; a later one resumes from the mount journal.
    ``ready(session)`` is called once the mount is usable (``session.mode`` known). Files are owned by this
    process's user and group, readable by all, unless ``access`` says otherwise. ``sampler``: the readers'
    declared sampler, whose orders the daemon publishes one epoch ahead of them."""
    # Request threads and the event-loop thread hand the GIL back and forth for every fetched READ; the default
    # 5 ms switch interval would add up to that much to each such request.
    sys.setswitchinterval(0.0002)
    fd, info = receive_fd(attach)
    cache_dir = config.cache.dir
    resume = info.get("generation", 0) > 0
    journal, inodes = _kernel_state(cache_dir, mountpoint, resume)
    engine = get_engine(config)
    init = journal.state.init
    version = init["manifest_version"] if init else None
    if version is not None and is_provisional(version):
        version = None  # (the previous daemon served the tree while its first manifest was taken: open it again)
    try:
        # Lazily unless readers declared a sampler: its orders need every file's path at once.
        ds = run_sync(engine.open_dataset(url, manifest_version=version, lazy=sampler is None))
    except (OSError, ValueError) as exc:
        announce_failure(attach, str(exc))
        _close_kernel_state(journal, inodes, mountpoint)
        os.close(fd)
        raise
    if not record_pin(cache_dir, mountpoint, ds.ref.url, ds.version, os.getppid()):  # (the holder is our parent)
        log.warning("%s: no room to record that it serves manifest v%d; a refresh may drop it", mountpoint, ds.version)
    # The origin client takes a while to set up (hundreds of ms for S3): do it now, not in the first cold read.
    run_soon(ds.source.connect()).add_done_callback(_log_connect_failure)
    run_soon(engine.start_background())  # hits of local reads reach the index
    orders = None
    if sampler is not None:
        orders = SamplerPublisher(sampler, cache_dir, ds.ref.id, ds.ref.url,
                                  sampler_files((e.path for e in ds.walk_files()), sampler), engine.ordered.orders)
        orders.start()
    if ds.provisional:  # once the first manifest is taken, a refresh must keep it and a next daemon open it
        async def pin_when_settled() -> None:
            await ds.settled.wait()
            record_pin(cache_dir, mountpoint, ds.ref.url, ds.version, os.getppid())
            journal.serves(ds.version)

        run_soon(pin_when_settled())
    last = None

    def publish(s: FuseSession, tick: int) -> None:  # what `cachefs status` shows about this mount
        nonlocal last
        if orders is not None:
            orders.tick()
        if tick % 5 == 0:
            s.maybe_skip_opens()
        if tick % 30 == 29:  # let go of evicted objects the kernel still holds for idle passthrough
            s.fs.sweep()
        now = (dict(s.fs.stats), s.opens_skipped, engine.packs.chain.problem(ds.ref.id))
        if now != last and record_mount(cache_dir, mountpoint, ds.ref.url, s.mode, now[0],
                                        opens_skipped=now[1], mirror_problem=now[2]):
            last = now

    def on_init(s: FuseSession) -> None:
        record_mount(cache_dir, mountpoint, ds.ref.url, s.mode, s.fs.stats, opens_skipped=s.opens_skipped)
        s.publish_every_second(functools.partial(publish, s))
        if ready is not None:
            ready(s)

    fs = CacheFS(engine, ds, inodes=inodes, journal=journal, access=access or ReadAccess(os.geteuid(), os.getegid()),
                 backing=DeviceBacking(fd), prefill=prefill)
    session = FuseSession(fs, fd, workers=workers, passthrough=passthrough, skip_opens=skip_opens, io_uring=io_uring,
                          on_init=on_init)
    quiet_collector()  # the engine, the manifest and the origin client are built: set them aside
    try:
        announce_ready(attach)  # the holder stops answering requests itself before we read the first one
        session.serve(resume=resume)
    finally:
        forget_mount(cache_dir, mountpoint)
        _close_kernel_state(journal, inodes, mountpoint)
        os.close(fd)
    return session


def _kernel_state(cache_dir: str, mountpoint: str, resume: bool) -> tuple[MountJournal, InodeTable]:
    """What the kernel was told about the mount: its journal and inode table, new for its first daemon, taken up by
    a later one (with the inodes a previous release journalled moved into the table: hand-over version 1)."""
    path = mount_file(cache_dir, mountpoint, ".journal")
    journal = MountJournal.resume(path) if resume else MountJournal.start(path)
    inodes = InodeTable(mount_file(cache_dir, mountpoint, ".inodes"), generation=journal.state.generation,
                        fresh=not resume)
    if journal.state.inodes:
        inodes.adopt(journal.state.inodes, journal.state.versions)
        journal.inodes_moved()
    return journal, inodes


def _close_kernel_state(journal: MountJournal, inodes: InodeTable, mountpoint: str) -> None:
    journal.close()
    inodes.close()
    if not is_fuse_mount(mountpoint):  # (the mount ended: not left for a next daemon to take up)
        InodeTable.remove(inodes.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(journal.path)


def _log_connect_failure(fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.info("origin client not ready yet (%s); the first cold read will retry", fut.exception())


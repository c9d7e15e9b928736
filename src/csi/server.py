"""The CSI plugin process: gRPC on a unix socket, serving Identity, Node and (optionally) Controller.

    cachefs csi --endpoint unix:///csi/csi.sock --node-id "$NODE_NAME" --cache-dir /var/cache/cachefs \
        --mounter unix:///run/cachefs/mounter.sock

At start the node side repairs what a previous run left published (see :meth:`SessionManager.recover`).
With ``--mounter`` the FUSE sessions are started by ``cachefs csi-mounter`` in another container (see
:mod:`.mounter`); without it, by this process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from cachefs.base.errors import ConfigError
from cachefs.fuse.keeper import SessionKeeper
from csi.datasets import DatasetResolver
from csi.driver import DRIVER_NAME, ControllerService, IdentityService, NodeService
from csi.events import PodEvents
from csi.gen import csi_pb2_grpc as rpc
from csi.generations import successor_present
from csi.mounter import RemoteMounter
from csi.registration import Registration, bound_socket, superseded
from csi.sessions import SessionManager

__all__ = ["serve"]

#: How often the node plugin checks its published targets and repairs broken ones.
REPAIR_INTERVAL = 30.0
#: Default time a session no pod uses keeps running (a pod that comes back soon finds it mounted).
SESSION_IDLE_TIMEOUT = 600.0
#: Stopped with no next node pod in sight for this long, the plugin stops the sessions no pod uses.
SUCCESSOR_GRACE = 30.0

log = logging.getLogger("cachefs.csi")


def socket_path(endpoint: str) -> str:
    """The file of a ``unix:///path`` (or plain absolute path) endpoint."""
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://"):]
    elif endpoint.startswith("/"):
        path = endpoint
    else:
        raise ConfigError(f"endpoint {endpoint!r}: want unix:///path/to/the.sock")
    if not path.startswith("/"):
        raise ConfigError(f"endpoint {endpoint!r}: the socket path must be absolute")
    return path


def serve(endpoint: str, *, node_id: str, cache_dir: str, state_dir: str, cache_group: str = "",
          mounter: str = "", session_idle_timeout: float = SESSION_IDLE_TIMEOUT, node: bool = True,
          controller: bool = True, registration_dir: str = "", kubelet_registration_path: str = "",
          session_keeper: str = "", handover_wait: float = 0.0, kubeconfig: str | None = None,
          ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set). With ``registration_dir`` (kubelet's ``plugins_registry``,
    as this process sees it) the node plugin registers itself with kubelet, naming its socket by
    ``kubelet_registration_path`` (where kubelet finds it on the node). With ``session_keeper`` the node plugin
    keeps a copy of every FUSE session's descriptor there (:mod:`cachefs.fuse.keeper`); stopped, it goes on serving
    up to ``handover_wait`` seconds while the keeper keeps any (:func:`_wait_for_sessions`). Volumes that name a
    CacheDataset are read from the API server in-cluster, or through ``kubeconfig``."""
    if node and not node_id:
        raise ConfigError("--node-id is required for the node plugin (set it from the NODE_NAME env var)")
    if registration_dir and not (node and kubelet_registration_path.startswith("/")):
        raise ConfigError("--registration-dir needs the node plugin and --kubelet-registration-path (the absolute "
                          "path of the CSI socket on the node, e.g. /var/lib/kubelet/plugins/csi.cachefs.io/csi.sock)")
    path = socket_path(endpoint)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)  # left by a previous run
    remote = RemoteMounter(socket_path(mounter)) if mounter else None
    server = grpc.server(ThreadPoolExecutor(max_workers=16))

    def probe() -> tuple[bool, str]:
        if node and not os.path.exists("/dev/fuse"):
            return False, "/dev/fuse is missing (pass it into the container)"
        if not os.access(cache_dir, os.W_OK):
            return False, f"cache directory {cache_dir} is not writable"
        if node and remote is not None:
            return remote.healthy()
        return True, ""

    os.makedirs(cache_dir, exist_ok=True)
    stop = stop or threading.Event()
    rpc.add_IdentityServicer_to_server(IdentityService(controller=controller, ready=probe), server)
    if controller:
        rpc.add_ControllerServicer_to_server(ControllerService(os.path.join(state_dir, "controller")), server)
    keeper = SessionKeeper(session_keeper) if node and session_keeper else None
    if keeper is not None:  # first: a mounter restarted with this plugin finds the sessions its holders left
        keeper.start()
    if node:
        sessions = SessionManager(state_dir, cache_dir, remote)
        repaired = sessions.recover()
        if repaired:
            log.warning("repaired %d published volume(s): %s", len(repaired), ", ".join(repaired))
        rpc.add_NodeServicer_to_server(NodeService(sessions, node_id, cache_group, DatasetResolver(kubeconfig)), server)
        threading.Thread(target=_repair_loop, args=(sessions, stop, session_idle_timeout), name="cachefs-csi-repair",
                         daemon=True).start()
        threading.Thread(target=PodEvents(node_id, kubeconfig).run, args=(sessions, stop), name="cachefs-csi-events",
                         daemon=True).start()
    old_umask = os.umask(0o177)  # gRPC binds here: the socket is 0600, only root (kubelet) may call NodePublish
    try:
        server.add_insecure_port(f"unix://{path}")
    finally:
        os.umask(old_umask)
    server.start()
    bound = bound_socket(path)
    log.info("CSI plugin listening on %s (node %s, controller %s)", path, node, controller)
    # Only once the CSI socket answers: kubelet calls NodeGetInfo on it as soon as it sees the registration.
    registration = Registration(registration_dir, DRIVER_NAME, kubelet_registration_path) if registration_dir else None
    if registration is not None:
        registration.start()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready.set()
    # A timed wait: a signal the kernel hands to one of gRPC's threads only runs its Python handler once the
    # main thread wakes, and an untimed wait may never wake.
    while not stop.wait(1.0):
        pass
    if keeper is not None and handover_wait > 0:
        _wait_for_sessions(keeper, sessions, handover_wait)
    _stop(server, path, bound, registration, keeper)


def _stop(server: grpc.Server, path: str, bound: tuple[int, int], registration: Registration | None,
          keeper: SessionKeeper | None) -> None:
    if superseded(path, bound) or (registration is not None and registration.superseded()):
        # The next node pod's plugin bound these paths and kubelet talks to it. Stopping a gRPC server removes the
        # socket at the path it bound, whoever's it is now: so this one is not stopped, the process just ends.
        log.warning("the next node pod's plugin serves kubelet now: leaving its sockets as they are")
        if keeper is not None:
            keeper.stop()
        if threading.current_thread() is threading.main_thread():
            logging.shutdown()
            os._exit(0)
        return
    if registration is not None:
        registration.stop()
    server.stop(grace=5).wait(10)
    if keeper is not None:
        keeper.stop()


def _wait_for_sessions(keeper: SessionKeeper, sessions: SessionManager, timeout: float) -> None:
    """Serve on (NodeUnpublish above all) while the keeper keeps sessions, up to ``timeout`` seconds: the next node
    pod takes them over (its keeper takes each copy from this one), or, when none is coming (the DaemonSet is being
    removed), their pods end; sessions no pod uses are stopped once no next pod has shown up for
    ``SUCCESSOR_GRACE`` seconds, rather than after the idle time."""
    started = time.monotonic()
    deadline = started + timeout
    said = -1
    while (left := len(keeper.sessions())) and time.monotonic() < deadline:
        # (a deleted pod's successor starts a few seconds after it is told to stop: idle sessions wait for it)
        if time.monotonic() - started >= SUCCESSOR_GRACE and not successor_present(keeper.path):
            sessions.stop_idle_sessions(0)
        if left != said:
            log.warning("stopping: %d session(s) kept here wait for the next node pod or for their pods to end",
                        left)
            said = left
        time.sleep(0.5)


def _repair_loop(sessions: SessionManager, stop: threading.Event, idle_timeout: float) -> None:
    while not stop.wait(REPAIR_INTERVAL):
        try:
            repaired = sessions.recover()
            sessions.stop_idle_sessions(idle_timeout)
        except Exception:  # the loop must survive anything; the next round retries
            log.exception("checking published volumes")
            continue
        if repaired:
            log.warning("repaired %d published volume(s): %s", len(repaired), ", ".join(repaired))

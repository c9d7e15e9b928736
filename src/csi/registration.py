"""The node plugin registers itself with kubelet (kubelet's plugin registration API v1), so the node pod needs no
node-driver-registrar sidecar.

kubelet watches its ``plugins_registry`` directory for sockets; for each new one it calls ``GetInfo``, learns the
driver's name and the CSI socket it should use (the path *kubelet* sees, not this container's), registers the driver
(``NodeGetInfo`` on that socket, then the node's CSINode object), and reports the outcome with
``NotifyRegistrationStatus``. When the socket disappears, kubelet unregisters the driver; a restarted plugin makes a
new one and is registered again. Volumes already published are not touched by either.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from cachefs.base.errors import ConfigError
from cachefs.base.sockets import SUN_PATH_MAX
from csi.gen import pluginregistration_pb2 as pb
from csi.gen import pluginregistration_pb2_grpc as rpc

__all__ = ["CSI_VERSIONS", "Registration", "bound_socket", "registration_socket", "superseded"]

log = logging.getLogger("cachefs.csi")

#: The CSI versions the plugin speaks, as kubelet wants them listed.
CSI_VERSIONS = ("1.0.0",)


def registration_socket(registration_dir: str, driver: str) -> str:
    """Where the registration socket of ``driver`` lives (the name kubelet's other plugins use too)."""
    return os.path.join(registration_dir, f"{driver}-reg.sock")


class _Service(rpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: str, notified: threading.Event) -> None:
        self.driver, self.endpoint, self.notified = driver, endpoint, notified
        self.registered: bool | None = None  # None until kubelet has said
        self.error = ""

    def GetInfo(self, request, context):
        return pb.PluginInfo(type="CSIPlugin", name=self.driver, endpoint=self.endpoint,
                             supported_versions=list(CSI_VERSIONS))

    def NotifyRegistrationStatus(self, request, context):
        self.registered, self.error = request.plugin_registered, request.error
        if request.plugin_registered:
            log.info("registered with kubelet as %s (CSI socket %s)", self.driver, self.endpoint)
        else:
            log.error("kubelet refused the registration of %s: %s", self.driver, request.error)
        self.notified.set()
        return pb.RegistrationStatusResponse()


class Registration:
    """The registration socket of one driver: ``start()`` serves it, ``stop()`` removes it (kubelet then
    unregisters the driver). ``endpoint`` is the CSI socket's path on the node, as kubelet sees it."""

    def __init__(self, registration_dir: str, driver: str, endpoint: str) -> None:
        if not os.path.isabs(endpoint):
            raise ValueError(f"the kubelet registration path {endpoint!r} must be absolute")
        self.path = registration_socket(registration_dir, driver)
        self.notified = threading.Event()
        self._service = _Service(driver, endpoint, self.notified)
        self._server: grpc.Server | None = None
        self._bound: tuple[int, int] | None = None  # (device, inode) of the socket this process bound

    @property
    def status(self) -> tuple[bool | None, str]:
        """(registered, kubelet's error): ``None`` until kubelet has answered."""
        return self._service.registered, self._service.error

    def start(self) -> None:
        if len(self.path.encode()) > SUN_PATH_MAX:
            raise ConfigError(f"registration socket {self.path}: longer than the {SUN_PATH_MAX} bytes a unix socket "
                              "path may have (choose a shorter --registration-dir)")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if os.path.lexists(self.path):
            os.unlink(self.path)  # left by a previous run: kubelet is told about the new one when it appears
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        rpc.add_RegistrationServicer_to_server(self._service, server)
        old_umask = os.umask(0o177)  # 0600: kubelet runs as root; nobody else needs to ask
        try:
            server.add_insecure_port(f"unix://{self.path}")
        finally:
            os.umask(old_umask)
        server.start()
        self._server = server
        self._bound = bound_socket(self.path)
        log.info("registration socket for kubelet at %s", self.path)

    def superseded(self) -> bool:
        """Whether another process bound the socket's path since (the next node pod registered itself)."""
        return superseded(self.path, self._bound)

    def stop(self) -> None:
        """Stop serving and remove the socket (kubelet then unregisters the driver). Call it only when not
        :meth:`superseded`: gRPC removes whatever socket is at the path it bound, the next node pod's too."""
        if self._server is not None:
            self._server.stop(grace=1).wait(5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def bound_socket(path: str) -> tuple[int, int]:
    """(device, inode) of the socket just bound at ``path``, for :func:`superseded`."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def superseded(path: str, bound: tuple[int, int] | None) -> bool:
    """Whether the socket at ``path`` is no longer the one this process bound (``bound``: :func:`bound_socket`)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return bound is not None and (st.st_dev, st.st_ino) != bound

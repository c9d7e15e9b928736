"""The CSI services (spec v1.12.0): Identity, a minimal Controller and the Node plugin.

Every call validates its request first (INVALID_ARGUMENT with a message saying what is missing), takes the
volume's lock (ABORTED while another call on the same volume runs, as the spec asks), returns OK when the
volume is already in the requested state, and only then acts. Requests are logged by method, volume id and
path; secrets and volume contexts are never logged.

Datasets are read-only: multi-node writer modes (ReadWriteMany) are refused; single-node writer modes are accepted
and mounted read-only (writes fail with EROFS), because kubelet sends SINGLE_NODE_WRITER for inline volumes and
ReadWriteOnce claims even when the pod mounts them read-only. Checkpoint volumes (``writable: "true"``) take every
access mode and are bound read-write (unless the pod mounts them read-only); NodeUnpublishVolume of a node's last
publish of one waits for its uploads first, bounded. Only the mount access type is supported (no raw block
devices).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from contextlib import contextmanager

import grpc

from cachefs import __version__
from cachefs.base.errors import (
    AccessDeniedError,
    CacheFSError,
    CacheFullError,
    ConfigError,
    CredentialsError,
    InvalidURLError,
    ObjectNotFoundError,
    OriginUnavailableError,
)
from cachefs.base.files import atomic_write
from cachefs.base.metrics import CSI_CALLS, safely
from csi.datasets import DatasetLookupError, DatasetResolver
from csi.gen import csi_pb2 as pb
from csi.gen import csi_pb2_grpc as rpc
from csi.mounter import MounterUnavailable
from csi.sessions import SessionManager
from csi.volume import KUBE_ADDED, DatasetVolume, VolumeError, credentials_env

__all__ = ["DRIVER_NAME", "TOPOLOGY_KEY", "ControllerService", "IdentityService", "NodeService"]

log = logging.getLogger("cachefs.csi")

DRIVER_NAME = "csi.cachefs.io"
TOPOLOGY_KEY = "topology.cachefs.io/cache-group"


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _grpc_code(exc: OSError) -> grpc.StatusCode:
    """The status for kubelet of an error that stopped a call: what it names, so that ``kubectl describe pod``
    says a bucket is missing or credentials are refused rather than "internal"."""
    for cls, code in ((ConfigError, grpc.StatusCode.INVALID_ARGUMENT), (InvalidURLError, grpc.StatusCode.INVALID_ARGUMENT),
                      (CredentialsError, grpc.StatusCode.PERMISSION_DENIED),
                      (AccessDeniedError, grpc.StatusCode.PERMISSION_DENIED),
                      (ObjectNotFoundError, grpc.StatusCode.NOT_FOUND),
                      (OriginUnavailableError, grpc.StatusCode.UNAVAILABLE),
                      (CacheFullError, grpc.StatusCode.RESOURCE_EXHAUSTED)):
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def _rpc(method):
    """Run a handler, turning our errors into gRPC status codes once, here; every call is counted by method and
    code (cachefs_csi_calls_total)."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        code = grpc.StatusCode.OK
        try:
            return method(self, request)
        except _Abort as exc:
            code = exc.code
            context.abort(exc.code, exc.message)
        except VolumeError as exc:
            code = grpc.StatusCode.INVALID_ARGUMENT
            context.abort(code, str(exc))
        except MounterUnavailable as exc:
            log.error("%s: %s", method.__name__, exc)
            code = grpc.StatusCode.UNAVAILABLE
            context.abort(code, str(exc))
        except (CacheFSError, OSError) as exc:
            log.error("%s: %s", method.__name__, exc)
            code = _grpc_code(exc)
            context.abort(code, str(exc))
        finally:
            safely(CSI_CALLS.labels(method.__name__, code.name).inc)
    return wrapper


def _require(value, what: str) -> None:
    if not value:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is required")


_MULTI_WRITERS = {pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER,
                  pb.VolumeCapability.AccessMode.MULTI_NODE_SINGLE_WRITER}
#: Longest volume id accepted (ids carry the dataset URL; Kubernetes object names are far shorter).
MAX_VOLUME_ID = 4096


def _check_volume_id(volume_id: str) -> None:
    _require(volume_id, "volume_id")
    if len(volume_id) > MAX_VOLUME_ID:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"volume_id is {len(volume_id)} bytes, over {MAX_VOLUME_ID}")


def _check_capability(cap: pb.VolumeCapability, *, writable: bool = False) -> None:
    if cap.access_mode.mode in _MULTI_WRITERS and not writable:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "cachefs volumes are read-only datasets: multi-node writer "
                     "access (ReadWriteMany) is not supported; use ReadOnlyMany")
    if cap.HasField("block"):
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "cachefs volumes are file systems: block access is not supported")
    if not cap.HasField("mount"):
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "volume capability needs an access type (mount)")


class _VolumeLocks:
    """One call at a time per volume; a concurrent call is told ABORTED (the CO retries)."""

    def __init__(self) -> None:
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, volume_id: str):
        with self._lock:
            if volume_id in self._busy:
                raise _Abort(grpc.StatusCode.ABORTED, f"an operation on volume {volume_id} is already in progress")
            self._busy.add(volume_id)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(volume_id)


class IdentityService(rpc.IdentityServicer):
    def __init__(self, *, controller: bool, ready) -> None:
        self.controller, self.ready = controller, ready

    @_rpc
    def GetPluginInfo(self, request):
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @_rpc
    def GetPluginCapabilities(self, request):
        caps = []
        if self.controller:
            caps.append(pb.PluginCapability(service=pb.PluginCapability.Service(
                type=pb.PluginCapability.Service.CONTROLLER_SERVICE)))
        return pb.GetPluginCapabilitiesResponse(capabilities=caps)

    @_rpc
    def Probe(self, request):
        ok, why = self.ready()
        if not ok:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        return pb.ProbeResponse(ready={"value": True})


class ControllerService(rpc.ControllerServicer):
    """Dynamic provisioning without copying data: a StorageClass's parameters name the dataset. Volume names
    are remembered (``controller.json``) so a repeated CreateVolume is idempotent and a conflicting one is
    refused."""

    def __init__(self, state_dir: str) -> None:
        os.makedirs(state_dir, exist_ok=True)
        self._path = os.path.join(state_dir, "controller.json")
        self._locks = _VolumeLocks()
        self._lock = threading.Lock()
        try:
            with open(self._path) as f:
                self._names: dict[str, dict] = json.load(f)
        except (FileNotFoundError, ValueError):
            self._names = {}

    def _save(self) -> None:
        atomic_write(self._path, json.dumps(self._names), fsync=True)  # volumes outlive the node's processes

    @_rpc
    def CreateVolume(self, request):
        _require(request.name, "name")
        _require(request.volume_capabilities, "volume_capabilities")
        params = {k: v for k, v in request.parameters.items() if not k.startswith("csi.storage.k8s.io/")}
        vol = DatasetVolume.from_attributes(params)
        for cap in request.volume_capabilities:
            _check_capability(cap, writable=vol.writable)
        size = request.capacity_range.required_bytes or request.capacity_range.limit_bytes
        volume_id = vol.volume_id_for(request.name)
        with self._locks.hold(request.name), self._lock:
            known = self._names.get(request.name)
            if known and (known["id"] != volume_id or known["bytes"] != size):
                raise _Abort(grpc.StatusCode.ALREADY_EXISTS,
                             f"volume {request.name!r} exists with other parameters or capacity")
            self._names[request.name] = {"id": volume_id, "bytes": size}
            self._save()
        log.info("CreateVolume %s → %s", request.name, volume_id)
        return pb.CreateVolumeResponse(volume=pb.Volume(volume_id=volume_id, capacity_bytes=size,
                                                        volume_context=vol.attributes()))

    @_rpc
    def DeleteVolume(self, request):
        _require(request.volume_id, "volume_id")
        with self._locks.hold(request.volume_id), self._lock:
            for name in [n for n, v in self._names.items() if v["id"] == request.volume_id]:
                del self._names[name]
            self._save()
        log.info("DeleteVolume %s (no data to delete)", request.volume_id)
        return pb.DeleteVolumeResponse()

    @_rpc
    def ValidateVolumeCapabilities(self, request):
        _require(request.volume_id, "volume_id")
        _require(request.volume_capabilities, "volume_capabilities")
        try:
            vol = volume_of(request.volume_id, dict(request.volume_context))
        except VolumeError as exc:
            raise _Abort(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        for cap in request.volume_capabilities:
            if not cap.HasField("mount"):
                return pb.ValidateVolumeCapabilitiesResponse(message="only the mount access type is supported")
        return pb.ValidateVolumeCapabilitiesResponse(confirmed=pb.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=vol.attributes(), volume_capabilities=request.volume_capabilities))

    @_rpc
    def ControllerGetCapabilities(self, request):
        cap = pb.ControllerServiceCapability.RPC.CREATE_DELETE_VOLUME
        return pb.ControllerGetCapabilitiesResponse(capabilities=[
            pb.ControllerServiceCapability(rpc=pb.ControllerServiceCapability.RPC(type=cap))])


class NodeService(rpc.NodeServicer):
    def __init__(self, sessions: SessionManager, node_id: str, cache_group: str = "",
                 datasets: DatasetResolver | None = None) -> None:
        self.sessions, self.node_id, self.cache_group = sessions, node_id, cache_group
        self.datasets = datasets or DatasetResolver()
        self._locks = _VolumeLocks()

    @_rpc
    def NodeGetCapabilities(self, request):
        types = (pb.NodeServiceCapability.RPC.GET_VOLUME_STATS, pb.NodeServiceCapability.RPC.VOLUME_CONDITION,
                 pb.NodeServiceCapability.RPC.VOLUME_MOUNT_GROUP)
        return pb.NodeGetCapabilitiesResponse(capabilities=[
            pb.NodeServiceCapability(rpc=pb.NodeServiceCapability.RPC(type=t)) for t in types])

    @_rpc
    def NodeGetInfo(self, request):
        topology = pb.Topology(segments={TOPOLOGY_KEY: self.cache_group}) if self.cache_group else None
        return pb.NodeGetInfoResponse(node_id=self.node_id, accessible_topology=topology)

    @_rpc
    def NodePublishVolume(self, request):
        _check_volume_id(request.volume_id)
        _require(request.target_path, "target_path")
        _require(request.HasField("volume_capability"), "volume_capability")
        vol = volume_of(request.volume_id, dict(request.volume_context)).for_group(
            _mount_group(request.volume_capability.mount.volume_mount_group))
        _check_capability(request.volume_capability, writable=vol.writable)
        env = credentials_env(dict(request.secrets))
        if vol.dataset:
            try:
                vol, env = self.datasets.resolve(vol, dict(request.volume_context), dict(request.secrets))
            except DatasetLookupError as exc:
                raise _Abort(exc.code, str(exc)) from None
        target = os.path.abspath(request.target_path)
        if os.path.lexists(target) and not os.path.isdir(target):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"target path {target} exists and is not a directory")
        with self._locks.hold(request.volume_id):
            if self.sessions.is_published(target, vol):
                return pb.NodePublishVolumeResponse()
            other = self.sessions.publishes.get(target)
            if other and other["volume_id"] != vol.volume_id:
                raise _Abort(grpc.StatusCode.ALREADY_EXISTS, f"{target} already holds volume {other['volume_id']}")
            self.sessions.publish(vol, target, env, readonly=request.readonly, pod=_pod_of(request.volume_context))
        log.info("NodePublishVolume %s at %s", request.volume_id, target)
        return pb.NodePublishVolumeResponse()

    @_rpc
    def NodeUnpublishVolume(self, request):
        _check_volume_id(request.volume_id)
        _require(request.target_path, "target_path")
        with self._locks.hold(request.volume_id):
            self.sessions.unpublish(os.path.abspath(request.target_path))
        log.info("NodeUnpublishVolume %s at %s", request.volume_id, request.target_path)
        return pb.NodeUnpublishVolumeResponse()

    @_rpc
    def NodeGetVolumeStats(self, request):
        _require(request.volume_id, "volume_id")
        _require(request.volume_path, "volume_path")
        path = os.path.abspath(request.volume_path)
        rec = self.sessions.publishes.get(path)
        if rec is None or not os.path.exists(path):
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"volume {request.volume_id} is not published at {path}")
        abnormal, message = self.sessions.condition(path)
        usage = []
        if not abnormal:
            st = os.statvfs(path)
            total = st.f_blocks * st.f_frsize
            usage = [pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=total, used=total, available=0),
                     pb.VolumeUsage(unit=pb.VolumeUsage.INODES, total=st.f_files, used=st.f_files, available=0)]
        return pb.NodeGetVolumeStatsResponse(usage=usage, volume_condition=pb.VolumeCondition(abnormal=abnormal,
                                                                                               message=message))

    @_rpc
    def NodeStageVolume(self, request):
        raise _Abort(grpc.StatusCode.UNIMPLEMENTED, "cachefs volumes need no staging")

    @_rpc
    def NodeUnstageVolume(self, request):
        raise _Abort(grpc.StatusCode.UNIMPLEMENTED, "cachefs volumes need no staging")


def _pod_of(context) -> dict[str, str] | None:
    """The pod kubelet publishes for (podInfoOnMount), or None when it did not say."""
    pod = {k: context.get(f"csi.storage.k8s.io/pod.{k}", "") for k in ("name", "namespace", "uid")}
    return pod if pod["uid"] else None


def _mount_group(value: str) -> int | None:
    """The pod's fsGroup, which kubelet passes as the mount group (VOLUME_MOUNT_GROUP); None if it has none."""
    if not value:
        return None
    if not value.isdigit() or int(value) >= 2**32 - 1:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"volume_mount_group {value[:64]!r} is not a group id")
    return int(value)


def volume_of(volume_id: str, context: dict[str, str]) -> DatasetVolume:
    """A volume from its context (PVs and inline volumes carry the attributes) or, failing that, its id."""
    if set(context) - KUBE_ADDED:  # the volume is described by its attributes (a PV's or an inline volume's)
        return DatasetVolume.from_attributes(context)
    try:
        return DatasetVolume.from_volume_id(volume_id)
    except VolumeError:
        raise _Abort(grpc.StatusCode.NOT_FOUND, f"volume {volume_id!r} is not a cachefs volume and has no 'url' "
                     "attribute") from None


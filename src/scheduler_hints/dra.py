"""GPUs handed out by Dynamic Resource Allocation (``resource.k8s.io/v1``), as the extender counts them.

A DRA driver publishes each node's devices in ResourceSlices; pods ask for them through ResourceClaims (named, or
made per pod from a ResourceClaimTemplate), which kube-scheduler's DynamicResources plugin allocates. The
:class:`DraInventory` is fed by watches of those four kinds and answers what the extender needs:

- how many GPUs a node has (its GPU devices in the newest generation of each pool) and how many are allocated
  (devices named in the allocation results of claims), for nodes a driver publishes; the rest keep counting
  ``nvidia.com/gpu`` from the Node's allocatable, so one cluster may mix both;
- how many GPUs a pod asks for through its claims: per request of a GPU device class, ``count`` (default 1), or
  a whole node's GPUs for ``allocationMode: All``; a claim already allocated asks for nothing more (its devices
  are counted where they are), and a named claim shared by several pods counts once, for the first of them;
- topology the devices carry (an NVLink clique, a PCIe root …): device attributes mapped onto node-label keys,
  so the topology levels see them beside labels (a label on the Node wins);
- whether a device class maps ``nvidia.com/gpu`` onto DRA devices (``extendedResourceName``): pods asking for the
  extended resource then run on DRA nodes too, their devices allocated through a claim kube-scheduler makes.

A device is a GPU when its driver is one of ``gpu_drivers`` and it does not say it is something else (NVIDIA's
driver also publishes MIG slices, ``type: mig``). A device class is a GPU class when its name is a GPU driver's or
one of ``gpu_classes``, or when its CEL selectors compare ``device.driver`` with a GPU driver.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler_hints.dra_types import (
    ClaimSpec,
    DeviceClass,
    ExactRequest,
    ResourceClaim,
    ResourceClaimTemplate,
    ResourceSlice,
    read,
)
from scheduler_hints.pods import field_of

__all__ = ["DraConfig", "DraInventory"]

log = logging.getLogger(__name__)

#: Standard device attribute (Kubernetes) and NVIDIA's DRA driver's clique attribute, mapped to node-label keys.
DEFAULT_TOPOLOGY_ATTRIBUTES = {
    "gpu.nvidia.com/cliqueId": "nvidia.com/gpu.clique",
}

EXTENDED_GPU = "nvidia.com/gpu"
#: Watch events that carry an object (the reflector also says "SYNC" after each list).
_EVENTS = ("ADDED", "MODIFIED", "DELETED")
_DRIVER_IN_CEL = re.compile(r"device\.driver\s*==\s*['\"]([^'\"]+)['\"]")

#: A device: (driver, pool, device name).
Ident = tuple[str, str, str]


@dataclass(frozen=True)
class DraConfig:
    #: Drivers whose devices are GPUs (unless a device's ``type`` attribute says otherwise).
    gpu_drivers: tuple[str, ...] = ("gpu.nvidia.com",)
    #: Device classes that hand out GPUs beside those recognised from their selectors.
    gpu_classes: tuple[str, ...] = ()
    #: Device attribute (qualified name) → the node-label key it stands for in the topology levels.
    topology_attributes: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_TOPOLOGY_ATTRIBUTES))


@dataclass
class _Device:
    node: str
    gpu: bool
    attributes: dict[str, str]


@dataclass
class _NodeDevices:
    """One node's devices, the topology its GPUs share, and a version that changes with either."""

    idents: set[Ident] = field(default_factory=set)
    topology: dict[str, str] = field(default_factory=dict)
    version: int = 0


def _allocated(claim: ResourceClaim) -> list[Ident]:
    allocation = claim.status.allocation
    return [] if allocation is None else [(r.driver, r.pool, r.device) for r in allocation.devices.results]


def _unreadable(kind: str, obj: Any) -> None:
    name = field_of(field_of(obj, "metadata"), "name") if isinstance(obj, Mapping) else None
    log.warning("ignored a %s whose fields have the wrong shape (%s)", kind, name or "no name")


class DraInventory:
    """ResourceSlices, ResourceClaims, ResourceClaimTemplates and DeviceClasses from watches (``on_*``), and the
    GPU counts and demands read from them. Not thread-safe: fed and read on the extender's event loop."""

    def __init__(self, config: DraConfig | None = None) -> None:
        self.config = config or DraConfig()
        #: (driver, pool) → (generation, {slice name: [(device name, device)]}): only the newest generation counts.
        self._pools: dict[tuple[str, str], tuple[int, dict[str, list[tuple[str, _Device]]]]] = {}
        self._devices: dict[Ident, _Device] = {}
        self._nodes: dict[str, _NodeDevices] = {}
        self._node_gpus: dict[str, int] = {}  # (read per request: kept apart from _nodes)
        self._allocated_gpus: dict[str, int] = {}  # node → GPUs allocated to claims
        self._allocated_idents: dict[Ident, int] = {}  # device → how many claims name it
        self._claims: dict[str, ResourceClaim] = {}
        self._templates: dict[str, ResourceClaimTemplate] = {}
        self._gpu_classes: set[str] = set(self.config.gpu_classes) | set(self.config.gpu_drivers)
        self._mapping_classes: set[str] = set()  # classes whose extendedResourceName is nvidia.com/gpu
        self._claim_users: dict[str, set[str]] = {}  # named claim key → keys of pods that reference it
        #: Nodes whose devices changed since the node cache last looked (it re-reads them and clears this).
        self.changed_nodes: set[str] = set()

    # -- the watches ----------------------------------------------------------------------------------------
    def on_slice(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind not in _EVENTS:
            return
        rs = read(obj, ResourceSlice)
        if rs is None:
            return _unreadable("ResourceSlice", obj)
        spec, name = rs.spec, rs.metadata.name
        pool_key = (spec.driver, spec.pool.name)
        known = self._pools.get(pool_key)
        before = self._pool_idents(pool_key)
        if kind == "DELETED":
            if known is not None and name in known[1]:
                del known[1][name]
                self._rebuild(pool_key, before)
            return
        node = spec.node_name
        if not node:
            return  # devices not local to one node (network-attached): not GPUs of a node
        generation = spec.pool.generation
        if known is None or generation > known[0]:
            known = (generation, {})
        elif generation < known[0]:
            return  # an older generation: ignored until the driver replaces it
        gpu_driver = spec.driver in self.config.gpu_drivers
        devices: list[tuple[str, _Device]] = []
        for d in spec.devices:
            if not d.name:
                continue
            attributes = {n if "/" in n else f"{spec.driver}/{n}": text
                          for n, v in d.attributes.items() if (text := v.text()) is not None}
            kind_attr = attributes.get(f"{spec.driver}/type", "gpu")
            devices.append((d.name, _Device(node, gpu_driver and kind_attr == "gpu", attributes)))
        known[1][name] = devices
        self._pools[pool_key] = known
        self._rebuild(pool_key, before)

    def on_claim(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind not in _EVENTS:
            return
        claim = read(obj, ResourceClaim)
        if claim is None:
            return _unreadable("ResourceClaim", obj)
        key = claim.metadata.key
        old = self._claims.pop(key, None)
        before = _allocated(old) if old is not None else []
        now = [] if kind == "DELETED" else _allocated(claim)
        if kind != "DELETED":
            self._claims[key] = claim
        for ident in before:
            left = self._allocated_idents.get(ident, 0) - 1
            if left > 0:
                self._allocated_idents[ident] = left
            else:
                self._allocated_idents.pop(ident, None)
        for ident in now:
            self._allocated_idents[ident] = self._allocated_idents.get(ident, 0) + 1
        for ident in {*before, *now}:
            dev = self._devices.get(ident)
            if dev is not None:
                self._recount_allocated(dev.node)

    def on_template(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind not in _EVENTS:
            return
        template = read(obj, ResourceClaimTemplate)
        if template is None:
            return _unreadable("ResourceClaimTemplate", obj)
        if kind == "DELETED":
            self._templates.pop(template.metadata.key, None)
        else:
            self._templates[template.metadata.key] = template

    def on_class(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind not in _EVENTS:
            return
        dc = read(obj, DeviceClass)
        if dc is None:
            return _unreadable("DeviceClass", obj)
        name = dc.metadata.name
        if kind == "DELETED":
            if name not in self.config.gpu_classes and name not in self.config.gpu_drivers:
                self._gpu_classes.discard(name)
            self._mapping_classes.discard(name)
            return
        if dc.spec.extended_resource_name == EXTENDED_GPU:
            # pods asking for nvidia.com/gpu get this class's devices (DRA's extended-resource mapping)
            self._gpu_classes.add(name)
            self._mapping_classes.add(name)
        else:
            self._mapping_classes.discard(name)
        for sel in dc.spec.selectors:
            if sel.cel is not None and any(d in self.config.gpu_drivers
                                           for d in _DRIVER_IN_CEL.findall(sel.cel.expression)):
                self._gpu_classes.add(name)

    def on_pod(self, kind: str, pod: Mapping[str, Any], key: str) -> None:
        """The pod watch: which pods share a named claim (the first of them counts it)."""
        namespace = str(field_of(pod, "metadata").get("namespace") or "default")
        for users in self._claim_users.values():
            users.discard(key)
        if kind == "DELETED":
            return
        for ref in field_of(pod, "spec").get("resourceClaims") or ():
            if isinstance(ref, Mapping) and isinstance(ref.get("resourceClaimName"), str):
                self._claim_users.setdefault(f"{namespace}/{ref['resourceClaimName']}", set()).add(key)

    def _pool_idents(self, pool_key: tuple[str, str]) -> set[Ident]:
        return {(*pool_key, name) for devices in self._pools.get(pool_key, (0, {}))[1].values()
                for name, _dev in devices}

    def _rebuild(self, pool_key: tuple[str, str], before: set[Ident]) -> None:
        """Re-index the devices of one pool (``before``: its devices as they were) and recount the nodes it
        touches."""
        touched = set()
        for ident in before:
            dev = self._devices.pop(ident, None)
            if dev is not None:
                self._nodes[dev.node].idents.discard(ident)
                touched.add(dev.node)
        for devices in self._pools.get(pool_key, (0, {}))[1].values():
            for name, dev in devices:
                ident = (*pool_key, name)
                self._devices[ident] = dev
                self._nodes.setdefault(dev.node, _NodeDevices()).idents.add(ident)
                touched.add(dev.node)
        for node in touched:
            self._recount(node)

    def _recount(self, node: str) -> None:
        here = self._nodes.setdefault(node, _NodeDevices())
        gpus = [d for d in map(self._devices.__getitem__, here.idents) if d.gpu]
        if gpus:
            self._node_gpus[node] = len(gpus)
        else:
            self._node_gpus.pop(node, None)
        topology: dict[str, str] = {}
        for attr, label in self.config.topology_attributes.items():
            values = {d.attributes[attr] for d in gpus if attr in d.attributes}
            if len(values) == 1:  # (a node whose GPUs sit in two cliques is in neither as a whole)
                topology[label] = values.pop()
        here.topology = topology
        here.version += 1
        self.changed_nodes.add(node)
        self._recount_allocated(node)

    def _recount_allocated(self, node: str) -> None:
        here = self._nodes.get(node)
        count = sum(1 for ident in (here.idents if here is not None else ())
                    if ident in self._allocated_idents and self._devices[ident].gpu)
        if count:
            self._allocated_gpus[node] = count
        else:  # (only nodes with GPUs in use: the extender nets every listed node per request)
            self._allocated_gpus.pop(node, None)

    # -- what the extender reads ----------------------------------------------------------------------------
    def node_gpus(self, node: str) -> int | None:
        """GPUs a DRA driver publishes for ``node``, or None when none does (count its extended resource)."""
        return self._node_gpus.get(node)

    def maps_extended_resource(self) -> bool:
        """Whether a device class hands out its devices to pods asking for ``nvidia.com/gpu`` (DRA's
        extended-resource mapping): such pods may then run on nodes a DRA driver publishes."""
        return bool(self._mapping_classes)

    def publishes_nodes(self) -> bool:
        """Whether any node's GPUs come from a DRA driver."""
        return bool(self._node_gpus)

    def node_version(self, node: str) -> int:
        """Changes whenever the node's devices (count, topology) change."""
        here = self._nodes.get(node)
        return here.version if here is not None else 0

    def node_topology(self, node: str) -> Mapping[str, str]:
        """Node-label keys and values the node's GPU devices carry (:attr:`DraConfig.topology_attributes`)."""
        here = self._nodes.get(node)
        return here.topology if here is not None else {}

    def allocated_by_node(self) -> Mapping[str, int]:
        """GPUs allocated to claims, per node (kept current by the watches; do not change it)."""
        return self._allocated_gpus

    def largest_node(self) -> int:
        """The most GPUs any one node has (what ``allocationMode: All`` asks for)."""
        return max(self._node_gpus.values(), default=0)

    def pod_gpus(self, pod: Mapping[str, Any], key: str) -> int:
        """GPUs the pod still asks for through its resource claims (see the module's docstring)."""
        refs = field_of(pod, "spec").get("resourceClaims")
        if not refs:
            return 0
        namespace = str(field_of(pod, "metadata").get("namespace") or "default")
        status = field_of(pod, "status")
        generated = {str(s.get("name")): s.get("resourceClaimName")
                     for s in status.get("resourceClaimStatuses") or () if isinstance(s, Mapping)}
        total = 0
        for ref in refs:
            if not isinstance(ref, Mapping):
                continue
            claim_spec: ClaimSpec | None = None
            if isinstance(ref.get("resourceClaimName"), str):
                claim_key = f"{namespace}/{ref['resourceClaimName']}"
                users = sorted(self._claim_users.get(claim_key, ()))
                claim = self._claims.get(claim_key)
                if (claim is not None and _allocated(claim)) or (users and users[0] != key):
                    continue  # held where it is allocated, or counted for the first pod that shares it
                claim_spec = claim.spec if claim is not None else None
            elif isinstance(ref.get("resourceClaimTemplateName"), str):
                made = generated.get(str(ref.get("name")))
                if isinstance(made, str) and made:
                    claim = self._claims.get(f"{namespace}/{made}")
                    if claim is not None and _allocated(claim):
                        continue
                    if claim is not None:
                        claim_spec = claim.spec
                if claim_spec is None:
                    template = self._templates.get(f"{namespace}/{ref['resourceClaimTemplateName']}")
                    claim_spec = template.spec.spec if template is not None else None
            total += self._claim_gpus(claim_spec)
        return total

    def _claim_gpus(self, spec: ClaimSpec | None) -> int:
        total = 0
        for request in spec.devices.requests if spec is not None else ():
            if request.exactly is not None:
                total += self._request_gpus(request.exactly)
            elif request.first_available:
                # the allocator takes the first alternative that fits: count the preferred one
                total += self._request_gpus(request.first_available[0])
        return total

    def _request_gpus(self, request: ExactRequest) -> int:
        if request.device_class_name not in self._gpu_classes:
            return 0
        if request.allocation_mode == "All":
            return self.largest_node()
        return max(0, min(request.count or 1, 1 << 20))

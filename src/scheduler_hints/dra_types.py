"""The parts of ``resource.k8s.io/v1`` objects the extender reads, as typed structs (msgspec).

Field names follow the API's JSON (camelCase, converted by ``rename="camel"``); what the extender does not read is
left out and ignored on input. Numbers sent as strings are accepted (``strict=False``), as the API server's own
decoder is lenient there; an object whose fields have the wrong shape is refused whole (:func:`read`), never half
read.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

__all__ = ["Device", "DeviceClass", "DeviceRequest", "ExactRequest", "ResourceClaim", "ResourceClaimTemplate",
           "ResourceSlice", "read"]


class _Api(msgspec.Struct, rename="camel", frozen=True):
    pass


class Meta(_Api, frozen=True):
    name: str = ""
    namespace: str | None = "default"

    @property
    def key(self) -> str:
        return f"{self.namespace or 'default'}/{self.name}"


# -- ResourceSlice ----------------------------------------------------------------------------------------------
class AttributeValue(_Api, frozen=True):
    """One of the four kinds of value a device attribute holds (the API's ``string``, ``int``, ``bool``,
    ``version``; named so as not to shadow the builtins here)."""

    string: str | None = None
    integer: int | None = msgspec.field(name="int", default=None)
    boolean: bool | None = msgspec.field(name="bool", default=None)
    version: str | None = None

    def text(self) -> str | None:
        """The value as a string (booleans as ``true``/``false``), or None when it holds none."""
        for value in (self.string, self.integer, self.boolean, self.version):
            if value is not None:
                return str(value).lower() if isinstance(value, bool) else str(value)
        return None


class Device(_Api, frozen=True):
    name: str = ""
    attributes: dict[str, AttributeValue] = {}


class Pool(_Api, frozen=True):
    name: str = ""
    generation: int = 0


class SliceSpec(_Api, frozen=True):
    driver: str = ""
    pool: Pool = Pool()
    node_name: str | None = None
    devices: list[Device] = []


class ResourceSlice(_Api, frozen=True):
    metadata: Meta = Meta()
    spec: SliceSpec = SliceSpec()


# -- ResourceClaim and its template -------------------------------------------------------------------------------
class ExactRequest(_Api, frozen=True):
    device_class_name: str = ""
    allocation_mode: str = ""
    count: int | None = None


class DeviceRequest(_Api, frozen=True):
    name: str = ""
    exactly: ExactRequest | None = None
    first_available: list[ExactRequest] | None = None


class DeviceClaim(_Api, frozen=True):
    requests: list[DeviceRequest] = []


class ClaimSpec(_Api, frozen=True):
    devices: DeviceClaim = DeviceClaim()


class AllocationResult(_Api, frozen=True):
    driver: str = ""
    pool: str = ""
    device: str = ""


class AllocatedDevices(_Api, frozen=True):
    results: list[AllocationResult] = []


class Allocation(_Api, frozen=True):
    devices: AllocatedDevices = AllocatedDevices()


class ClaimStatus(_Api, frozen=True):
    allocation: Allocation | None = None


class ResourceClaim(_Api, frozen=True):
    metadata: Meta = Meta()
    spec: ClaimSpec = ClaimSpec()
    status: ClaimStatus = ClaimStatus()


class TemplateSpec(_Api, frozen=True):
    spec: ClaimSpec = ClaimSpec()


class ResourceClaimTemplate(_Api, frozen=True):
    metadata: Meta = Meta()
    spec: TemplateSpec = TemplateSpec()


# -- DeviceClass --------------------------------------------------------------------------------------------------
class CelSelector(_Api, frozen=True):
    expression: str = ""


class Selector(_Api, frozen=True):
    cel: CelSelector | None = None


class ClassSpec(_Api, frozen=True):
    selectors: list[Selector] = []
    extended_resource_name: str | None = None


class DeviceClass(_Api, frozen=True):
    metadata: Meta = Meta()
    spec: ClassSpec = ClassSpec()


T = TypeVar("T")


def read(obj: Any, kind: type[T]) -> T | None:
    """``obj`` (a decoded watch object) as ``kind``, or None when its fields have the wrong shape."""
    try:
        return msgspec.convert(obj, kind, strict=False)
    except msgspec.ValidationError:
        return None

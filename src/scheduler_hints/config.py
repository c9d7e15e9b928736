"""Extender configuration: a frozen dataclass loaded from YAML (``--config``) and validated at start."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from cachefs.base.errors import ConfigError
from scheduler_hints.dra import DraConfig
from scheduler_hints.scoring import Weights

__all__ = ["ExtenderConfig", "load_extender_config"]


@dataclass(frozen=True)
class ExtenderConfig:
    weights: Weights = field(default_factory=Weights)
    #: Which DRA devices are GPUs and which of their attributes stand for topology labels (docs/SCHEDULING.md).
    dra: DraConfig = field(default_factory=DraConfig)
    #: Seconds a gang member's bind waits for the rest of its gang (keep below the extender httpTimeout).
    bind_timeout: float = 30.0
    #: Seconds an admitted gang may make no progress before its admission lapses.
    gang_ttl: float = 300.0
    #: Seconds a gang that one topology domain could hold waits for room there before it may span domains.
    topology_wait: float = 60.0
    #: Delay scheduling: seconds a pod or gang that could run now, but only where it reads clearly less of its
    #: data locally (by more than ``locality_slack`` of its bytes) than on the best nodes, waits for those.
    locality_wait: float = 300.0
    locality_slack: float = 0.2
    #: Largest request body accepted (a 413 beyond). The default holds the node names of a nodeCacheCapable
    #: extender (deploy/) many times over, and full Node objects of a few thousand nodes; raise it only for
    #: nodeCacheCapable: false on a large cluster.
    max_request_bytes: float = 32 * 1024 * 1024


def load_extender_config(path: str | None) -> ExtenderConfig:
    if not path:
        return ExtenderConfig()
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError:
        raise ConfigError(f"{path}: not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping")
    dra = _dra_config(path, data.pop("dra", {}) or {})
    w = data.pop("weights", {}) or {}
    known_w = {f.name for f in fields(Weights)}
    if not isinstance(w, dict) or set(w) - known_w:
        raise ConfigError(f"{path}: weights may set {', '.join(sorted(known_w))}")
    if "topology_levels" in w:
        w["topology_levels"] = tuple(str(x) for x in w["topology_levels"])
    known = {f.name for f in fields(ExtenderConfig)} - {"weights", "dra"}
    if set(data) - known:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(sorted(set(data) - known))}")
    try:
        given: dict[str, Any] = {k: (float(v) if k != "topology_levels" else v) for k, v in w.items()}
        weights = Weights(**given)
        cfg = ExtenderConfig(weights=weights, dra=dra, **{k: float(v) for k, v in data.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if min(cfg.weights.local, cfg.weights.domain, cfg.weights.packing, cfg.weights.packing_when_short,
           cfg.weights.topology) < 0:
        raise ConfigError(f"{path}: weights must not be negative")
    if cfg.bind_timeout <= 0 or cfg.gang_ttl <= 0 or min(cfg.topology_wait, cfg.locality_wait) < 0:
        raise ConfigError(f"{path}: bind_timeout and gang_ttl must be positive, topology_wait and locality_wait "
                          "not negative")
    if not 0 <= cfg.weights.hole_fit_when_short <= 1:
        raise ConfigError(f"{path}: weights.hole_fit_when_short is a fraction, 0 to 1")
    if not 0 <= cfg.weights.hole_data_spread <= 1:
        raise ConfigError(f"{path}: weights.hole_data_spread is a fraction of the pod's bytes, 0 to 1")
    if not 64 * 1024 <= cfg.max_request_bytes <= 1 << 30:
        raise ConfigError(f"{path}: max_request_bytes must be between 64 KiB and 1 GiB")
    if not 0 <= cfg.locality_slack <= 1:
        raise ConfigError(f"{path}: locality_slack is a fraction of the pod's bytes, 0 to 1")
    return cfg


def _dra_config(path: str, raw: Any) -> DraConfig:
    """The ``dra`` section: ``gpu_drivers`` and ``gpu_classes`` (lists of names), ``topology_attributes`` (device
    attribute → node-label key)."""
    known = {f.name for f in fields(DraConfig)}
    if not isinstance(raw, dict) or set(raw) - known:
        raise ConfigError(f"{path}: dra may set {', '.join(sorted(known))}")
    out: dict[str, Any] = {}
    for key in ("gpu_drivers", "gpu_classes"):
        if key in raw:
            value = raw[key]
            if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
                raise ConfigError(f"{path}: dra.{key} is a list of names")
            out[key] = tuple(value)
    if "topology_attributes" in raw:
        value = raw["topology_attributes"]
        if not isinstance(value, dict) or not all(isinstance(k, str) and "/" in k and isinstance(v, str) and v
                                                  for k, v in value.items()):
            raise ConfigError(f"{path}: dra.topology_attributes maps qualified device attributes "
                              "(driver/name) to node-label keys")
        out["topology_attributes"] = dict(value)
    return DraConfig(**out)

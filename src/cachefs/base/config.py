"""Configuration: frozen dataclasses, loaded once (defaults → YAML → ``CACHEFS_*`` env → flags) and validated.

Every knob has one name in three spellings: YAML ``section.field``, env ``CACHEFS_SECTION_FIELD``, and the
keyword ``section_field`` in the ``overrides`` mapping that the CLI's flags and the fsspec options fill in.
Sizes accept ``4MiB``, ``10GB``, plain integers, or (for capacity and the free-space floor) a percentage of
the cache filesystem such as ``90%``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cachefs.base.cluster_config import MAX_REPLICAS, ClusterConfig, parse_replicas
from cachefs.base.errors import ConfigError
from cachefs.base.values import (
    check_endpoint,
    check_size_or_percent,
    parse_listen,
    parse_size,
    prepare_cache_dir,
    resolve_size,
)

__all__ = ["MAX_REPLICAS", "CacheConfig", "CheckpointConfig",
           "ClusterConfig", "Config", "EngineConfig", "MetricsConfig", "OriginConfig",
           "default_cache_dir", "default_log_dir", "default_metrics_dir", "load_config",
           "parse_listen", "parse_replicas", "parse_size", "prepare_cache_dir", "resolve_size", "tier_names"]

def default_log_dir() -> str:
    """``/var/log/cachefs`` for root, else ``$XDG_STATE_HOME/cachefs`` (``~/.local/state/cachefs``)."""
    if os.geteuid() == 0:
        return "/var/log/cachefs"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "cachefs")


def default_metrics_dir() -> str:
    """``/run/cachefs/metrics`` for root, else ``$XDG_RUNTIME_DIR/cachefs/metrics`` ("" without a runtime dir)."""
    if os.geteuid() == 0:
        return "/run/cachefs/metrics"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "cachefs", "metrics") if runtime else ""


def default_cache_dir() -> str:
    """``/var/cache/cachefs`` for root (the node agent), else ``$XDG_CACHE_HOME/cachefs``."""
    if os.geteuid() == 0:
        return "/var/cache/cachefs"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cachefs")


@dataclass(frozen=True)
class CacheConfig:
    """The node-local store."""

    dir: str = field(default_factory=default_cache_dir)
    #: Where background mounts write their logs: not on the cache disk, so that a full cache disk never
    #: silences them.
    log_dir: str = field(default_factory=default_log_dir)
    #: Upper bound on cached bytes: a size or a percentage of the cache filesystem.
    capacity: str = "90%"
    #: Eviction starts when usage passes high_watermark × capacity and stops at low_watermark × capacity.
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    #: Keep at least this much of the cache filesystem free, whatever the capacity says (other tenants, logs).
    min_free: str = "5%"
    #: 4 MiB blocks: large enough that a 256 MiB object is 64 index records and ranged GETs are efficient
    #: on S3 (whose per-request latency dominates below ~1 MiB), small enough that a random read only
    #: fetches and verifies a little more than it needs.
    block_size: int = 4 * 1024 * 1024
    #: Objects of at most this many bytes are fetched whole and stored in pack files rather than one file each
    #: (0: never). Packed files are read from userspace (no FUSE passthrough); see bench/README.md for the
    #: measurement behind the default.
    pack_threshold: int = 1024 * 1024
    #: A pack file is written once this many bytes of small objects are waiting (or a second after the last).
    #: Up to two packs' worth of fetched bytes wait in memory, besides engine.memory_budget.
    pack_size: int = 32 * 1024 * 1024
    #: Which cached data goes first when the cache must shrink (cachefs.node.eviction_policy.POLICIES):
    #: "two-touch-lru" (objects read once before those read again, least recently used first within each;
    #: bench/eviction_bench.py) or "lru".
    eviction_policy: str = "two-touch-lru"
    #: A dataset read as an epoch scan (each file once per pass, in any order) keeps the part of it that fits and
    #: lets the rest pass through uncached, instead of evicting what the next epoch reads first (docs/SEMANTICS.md,
    #: "Epochs"). Off: it is cached like any other data, by eviction_policy.
    scan_admission: bool = True


@dataclass(frozen=True)
class OriginConfig:
    """How to reach the origin. Credentials default to the usual AWS chain (env, profile, instance role)."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    anonymous: bool = False
    #: Attempts per request, the first included; backoff is exponential with full jitter.
    max_attempts: int = 8
    backoff_base: float = 0.05
    backoff_max: float = 5.0
    request_timeout: float = 60.0
    connect_timeout: float = 5.0
    #: Concurrent LIST requests when taking a manifest.
    list_concurrency: int = 32
    #: S3 GETs and listing pages signed and sent by cachefs itself (SigV4; GETs on our HTTP/1.1 client, listings
    #: on aiohttp) instead of through botocore, which spent ~0.85 ms of CPU per GET and ~70 µs per listed
    #: object; errors still go through botocore. Off: every request through botocore.
    direct_get: bool = True


@dataclass(frozen=True)
class EngineConfig:
    """The read path."""

    #: Hard ceiling on bytes held in memory for in-flight fetches and read-ahead; fetches wait for room.
    memory_budget: int = 512 * 1024 * 1024
    #: Concurrent GETs per process: many, because small files are latency-bound (64 in flight at 10 ms RTT
    #: is ~6,400 requests/s).
    max_concurrent_fetches: int = 64
    #: Bytes on the wire at once. Measured on a 1 Gbit/s, 10 ms link (bench/read_bench.py): 8 × 4 MiB ranged
    #: GETs fill it (0.9× the link) while 32 × 4 MiB only contend (0.7×); raise it for faster links, or for
    #: origins that cap each connection's throughput.
    fetch_window: int = 32 * 1024 * 1024
    #: Read-ahead grows 1, 2, 4, … blocks on sequential reads up to this many bytes.
    readahead_max: int = 64 * 1024 * 1024
    #: Return freed fetch buffers to the OS at once (glibc's mmap threshold pinned at one block), so RSS stays
    #: within the budget; see cachefs/base/memory.py for the measurements. Process-wide; off leaves malloc alone.
    bound_allocator: bool = True
    #: Access statistics (LRU times, hit counters) are written to the index at most this often.
    stats_flush_interval: float = 2.0
    #: After a miss on a small file, fetch this many following files of its directory in the background.
    dir_readahead: int = 64
    #: With a declared read order (`cachefs order`, docs/SEMANTICS.md): fetch up to this many bytes of the files
    #: a reader will open next ahead of it (0: off). At most an eighth of the memory budget, which holds what
    #: the disk has no room for until its reader comes.
    order_lookahead: int = 32 * 1024 * 1024
    #: Per-directory access scores ("hot directories" in `cachefs status --json`) halve every this many seconds.
    hot_dir_half_life: float = 600.0
    #: Where missing bytes of small files come from, asked in this order (tier names, cachefs.tiers.TIERS): the
    #: cache group's members, the dataset's packed mirror, the origin. The origin must come last (it always
    #: answers).
    small_tiers: str = "peer,mirror,origin"
    #: The same for the blocks of large files (a mirror holds no blocks).
    block_tiers: str = "peer,origin"


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics (docs/METRICS.md)."""

    #: Where the node's cachefs processes write their metrics for the node's one scrape endpoint (prometheus-
    #: client's multiprocess files; on a memory file system, never the cache disk). "" keeps each process's
    #: metrics to itself.
    dir: str = field(default_factory=default_metrics_dir)


@dataclass(frozen=True)
class CheckpointConfig:
    """Writable checkpoint volumes (``cachefs mount --writable``, ``cachefs={"writable": True}``;
    docs/SEMANTICS.md)."""

    #: Bytes written and not yet on the origin that a node may hold (a size, or a percentage of the cache file
    #: system). Past it writers wait while the upload drains; they never get ENOSPC while it makes progress.
    staging_limit: str = "25%"
    #: Multipart part size: S3 allows 5MiB–5GiB; 16MiB keeps a 2GiB checkpoint at 128 parts, each one request.
    part_size: int = 16 * 1024 * 1024
    #: Parts in flight per volume (across files: later files upload while an earlier one completes).
    upload_concurrency: int = 8
    #: Seconds a writer waits for room past the staging limit while the upload makes no progress, before ENOSPC.
    stall_timeout: float = 600.0
    #: Other members of the node's cache group that hold a copy of each closed file until its upload, before
    #: close returns (0 outside a group).
    replicas: int = 1


def tier_names(spec: str) -> tuple[str, ...]:
    """``engine.small_tiers`` / ``engine.block_tiers``: ``peer,mirror,origin`` → ("peer", "mirror", "origin")."""
    return tuple(t.strip() for t in spec.split(",") if t.strip())


@dataclass(frozen=True)
class Config:
    cache: CacheConfig = field(default_factory=CacheConfig)
    origin: OriginConfig = field(default_factory=OriginConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> Config:
        c, o, e = self.cache, self.origin, self.engine
        if not c.dir:
            raise ConfigError("cache.dir must not be empty")
        if not 0 < c.low_watermark < c.high_watermark <= 1:
            raise ConfigError("need 0 < cache.low_watermark < cache.high_watermark <= 1")
        if c.block_size < 64 * 1024 or c.block_size > 256 * 1024 * 1024 or c.block_size & (c.block_size - 1):
            raise ConfigError("cache.block_size must be a power of two between 64KiB and 256MiB")
        check_size_or_percent(c.capacity, "cache.capacity")
        check_size_or_percent(c.min_free, "cache.min_free")
        if o.max_attempts < 1:
            raise ConfigError("origin.max_attempts must be at least 1")
        if o.backoff_base <= 0 or o.backoff_max < o.backoff_base:
            raise ConfigError("need 0 < origin.backoff_base <= origin.backoff_max")
        if o.endpoint_url is not None:
            check_endpoint(o.endpoint_url)
        if o.request_timeout <= 0 or o.connect_timeout <= 0:
            raise ConfigError("origin timeouts must be positive")
        if o.list_concurrency < 1:
            raise ConfigError("origin.list_concurrency must be at least 1")
        if (o.access_key_id is None) != (o.secret_access_key is None):
            raise ConfigError("origin.access_key_id and origin.secret_access_key must be given together")
        if c.pack_threshold < 0 or c.pack_threshold > 64 * 1024 * 1024:
            raise ConfigError("cache.pack_threshold must be between 0 (no packing) and 64MiB")
        if c.pack_threshold and c.pack_size < c.pack_threshold:
            raise ConfigError("cache.pack_size must hold at least one object of cache.pack_threshold bytes")
        if c.pack_size > 1024 * 1024 * 1024:
            raise ConfigError("cache.pack_size must be at most 1GiB (pack members are addressed with 32-bit offsets)")
        if e.dir_readahead < 0:
            raise ConfigError("engine.dir_readahead must not be negative")
        if e.order_lookahead < 0:
            raise ConfigError("engine.order_lookahead must not be negative")
        if e.hot_dir_half_life <= 0:
            raise ConfigError("engine.hot_dir_half_life must be positive")
        if e.max_concurrent_fetches < 1:
            raise ConfigError("engine.max_concurrent_fetches must be at least 1")
        if e.memory_budget < 2 * c.block_size:
            raise ConfigError(
                f"engine.memory_budget ({e.memory_budget} B) must hold at least two blocks ({2 * c.block_size} B)"
            )
        if e.fetch_window < c.block_size:
            raise ConfigError("engine.fetch_window must hold at least one block")
        if e.readahead_max < 0:
            raise ConfigError("engine.readahead_max must not be negative")
        for name in ("small_tiers", "block_tiers"):
            tiers = tier_names(getattr(e, name))
            if not tiers or tiers[-1] != "origin" or len(set(tiers)) != len(tiers):
                raise ConfigError(f"engine.{name} {getattr(e, name)!r}: tier names separated by commas, each once, "
                                  "the origin last")
        k = self.checkpoint
        check_size_or_percent(k.staging_limit, "checkpoint.staging_limit")
        if not 5 * 1024 * 1024 <= k.part_size <= 5 * 1024 * 1024 * 1024:
            raise ConfigError("checkpoint.part_size must be between 5MiB and 5GiB (S3's multipart limits)")
        if k.upload_concurrency < 1:
            raise ConfigError("checkpoint.upload_concurrency must be at least 1")
        if k.stall_timeout <= 0:
            raise ConfigError("checkpoint.stall_timeout must be positive")
        if not 0 <= k.replicas <= 3:
            raise ConfigError("checkpoint.replicas must be between 0 and 3")
        self.cluster.validate()
        return self

_SECTIONS = {"cache": CacheConfig, "origin": OriginConfig, "engine": EngineConfig, "metrics": MetricsConfig,
             "cluster": ClusterConfig, "checkpoint": CheckpointConfig}
_SIZE_FIELDS = {("cache", "block_size"), ("cache", "pack_threshold"), ("cache", "pack_size"),
                ("engine", "memory_budget"), ("engine", "readahead_max"),
                ("engine", "fetch_window"), ("engine", "order_lookahead"),
                ("checkpoint", "part_size")}


def _coerce(section: str, f: dataclasses.Field, raw: Any) -> Any:
    name = f"{section}.{f.name}"
    if (section, f.name) in _SIZE_FIELDS:
        return parse_size(raw, name)
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if raw is None:
        return None
    try:
        if kind.startswith("bool"):
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot read {raw!r} as {kind}") from None


def load_config(
    path: str | os.PathLike | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the one validated :class:`Config`: defaults, then the YAML file (``path`` or ``$CACHEFS_CONFIG``),
    then ``CACHEFS_<SECTION>_<FIELD>`` variables, then ``overrides`` (``{"cache_dir": ...}``; ``None`` values
    are ignored so unset flags do not clobber the layers below)."""
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    path = path or env.get("CACHEFS_CONFIG")
    if path:
        values_from_yaml = _read_yaml(Path(path))
        for section, body in values_from_yaml.items():
            if section not in _SECTIONS:
                raise ConfigError(f"{path}: unknown section {section!r} (known: {', '.join(_SECTIONS)})")
            if not isinstance(body, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping")
            known = {f.name for f in fields(_SECTIONS[section])}
            for k, v in body.items():
                if k not in known:
                    raise ConfigError(f"{path}: unknown key {section}.{k}")
                values[section][k] = v
    for section, cls in _SECTIONS.items():
        for f in fields(cls):
            key = f"CACHEFS_{section.upper()}_{f.name.upper()}"
            if key in env:
                values[section][f.name] = env[key]
            if overrides and overrides.get(f"{section}_{f.name}") is not None:
                values[section][f.name] = overrides[f"{section}_{f.name}"]
    if overrides:
        known = {f"{s}_{f.name}" for s, c in _SECTIONS.items() for f in fields(c)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(unknown)}")
    built = {}
    for section, cls in _SECTIONS.items():
        fmap = {f.name: f for f in fields(cls)}
        built[section] = cls(**{k: _coerce(section, fmap[k], v) for k, v in values[section].items()})
    return Config(**built).validate()


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def reference_markdown() -> str:
    """docs/CONFIGURATION.md, generated from the dataclasses above (a test keeps the file in step)."""
    lines = [
        "# Configuration",
        "",
        "Loaded once at start, in this order (later wins): defaults → YAML file (`--config` or `$CACHEFS_CONFIG`) →",
        "`CACHEFS_<SECTION>_<FIELD>` environment variables → command-line flags / fsspec options (`section_field=`).",
        "Invalid values stop the program with one clear line. Sizes take `4MiB`, `10GB` or plain bytes;",
        "`cache.capacity` and `cache.min_free` also take a percentage of the cache filesystem.",
        "",
        "S3 endpoint and credentials also follow the AWS conventions (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`/",
        "`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `AWS_REGION`, instance roles) when not set here. Secrets are never",
        "logged. Why each default is what it is: see the comments in `cachefs/base/config.py`.",
        "",
        "| YAML | environment | default |",
        "|---|---|---|",
    ]
    for section, cls in _SECTIONS.items():
        for f in fields(cls):
            default = f"`{f.default}`"
            if section == "cache" and f.name == "dir":
                default = "`/var/cache/cachefs` as root, else `~/.cache/cachefs`"
            elif section == "cache" and f.name == "log_dir":
                default = "`/var/log/cachefs` as root, else `~/.local/state/cachefs`"
            elif section == "metrics" and f.name == "dir":
                default = "`/run/cachefs/metrics` as root, else `$XDG_RUNTIME_DIR/cachefs/metrics`"
            lines.append(f"| `{section}.{f.name}` | `CACHEFS_{section.upper()}_{f.name.upper()}` | {default} |")
    lines += ["", "Command-line flags: `--cache-dir`, `--config`, `--capacity`, `--memory-budget`, `--endpoint-url`, "
              "`--region`, `--profile`.", ""]
    return "\n".join(lines)

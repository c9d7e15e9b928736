"""Values the configuration reads and checks: sizes (``4MiB``, ``10GB``, ``90%`` of a file system), listen addresses,
endpoint URLs, the cache directory itself, and who may read a mount."""

from __future__ import annotations

import grp
import os
import re
from dataclasses import dataclass
from typing import Any

from cachefs.base.errors import ConfigError

__all__ = [
    "ReadAccess",
    "check_endpoint",
    "check_size_or_percent",
    "human_bytes",
    "parse_group",
    "parse_listen",
    "parse_read_mode",
    "parse_size",
    "prepare_cache_dir",
    "resolve_size",
]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}


#: The largest size taken (2^63 - 1: what a file offset, and every counter of bytes here, can hold).
MAX_SIZE = (1 << 63) - 1


def parse_size(value: Any, name: str = "size") -> int:
    """Parse ``4MiB`` / ``10 GB`` / ``123`` into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: must not be negative")
        if value > MAX_SIZE:
            raise ConfigError(f"{name}: {value} is more than any disk or memory holds (at most 8 EiB)")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: cannot read {value!r} as a size (examples: 4MiB, 10GB, 1048576)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size > MAX_SIZE:
        raise ConfigError(f"{name}: {value!r} is more than any disk or memory holds (at most 8 EiB)")
    return size


def parse_listen(value: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) → (host, port); ConfigError naming ``flag`` otherwise."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} {value!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def prepare_cache_dir(path: str) -> None:
    """Create the cache directory (0700) if needed and check that it is writable; ConfigError naming the
    setting if not."""
    what = f"cache.dir (--cache-dir, CACHEFS_CACHE_DIR) {path}"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot create it ({exc.strerror})") from None
    if not os.path.isdir(path):
        raise ConfigError(f"{what}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        why = "read-only file system" if _read_only_fs(path) else "permission denied"
        raise ConfigError(f"{what}: not writable ({why})")


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_endpoint(url: str) -> None:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"origin.endpoint_url (--endpoint-url, CACHEFS_ORIGIN_ENDPOINT_URL): {url!r} is not an "
                          "http:// or https:// URL with a host")


def check_size_or_percent(value: str, name: str) -> None:
    s = str(value).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ConfigError(f"{name}: cannot read {value!r}") from None
        if not 0 <= pct <= 100:
            raise ConfigError(f"{name}: percentage must be within 0–100")
    else:
        parse_size(s, name)


def resolve_size(value: str, fs_total: int, name: str) -> int:
    """A size or ``N%`` of ``fs_total`` in bytes."""
    s = str(value).strip()
    if s.endswith("%"):
        return int(fs_total * float(s[:-1]) / 100)
    return parse_size(s, name)


@dataclass(frozen=True)
class ReadAccess:
    """Who may read a mount's files, as the kernel checks it (``default_permissions``): files are owned by
    ``uid``:``gid`` with the read bits ``mode`` (directories add the matching search bits). Root reads always."""

    uid: int
    gid: int
    mode: int = 0o444

    @property
    def file_mode(self) -> int:
        return self.mode

    @property
    def dir_mode(self) -> int:
        return self.mode | (self.mode & 0o444) >> 2


def parse_read_mode(text: str, flag: str = "--mode") -> int:
    """An octal mode of read bits only (``0444``, ``0440``, ``0400``): a read-only mount grants nothing else."""
    value = str(text).strip()
    try:
        mode = int(value, 8)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: want an octal mode of read bits, such as 0440") from None
    if mode & ~0o444 or mode & 0o400 == 0:
        raise ConfigError(f"{flag} {text!r}: only read bits (0444 at most) and the owner's read bit (0400) at least; "
                          "the mount is read-only")
    return mode


def parse_group(text: str, flag: str = "--group") -> int:
    """A group id from a number or a group name of this machine."""
    value = str(text).strip()
    if value.isdigit():
        gid = int(value)
        if gid >= 2**32 - 1:
            raise ConfigError(f"{flag} {text!r}: a group id is below 4294967295")
        return gid
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ConfigError(f"{flag} {text!r}: no such group on this machine (give a name or a numeric id)") from None


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 MiB``, ``3.2 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

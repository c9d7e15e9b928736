"""Hot directories: decaying request and byte rates per directory, as a member serving its group sees them.

Every answer a peer server gives (a block, a small file) is counted against its directory (dataset id and
directory path). A count decays exponentially with time constant ``tau``: ``score ← score·e^(−Δt/τ) + 1`` per
request (bytes likewise), and ``score / τ`` is the rate. A directory whose rate passes what one node should
serve (``hot_requests`` requests/s or ``hot_bytes`` bytes/s) becomes hot: its keys get ``replicas`` more holders
(the next rendezvous candidates), and the answers say so (:data:`HOT_HEADER`), so readers spread over the
holders. Spread, each holder sees 1/(r+1) of the directory's traffic: the group-wide rate is estimated as this
member's rate × (r+1), and a directory cools once that estimate falls below ``cool_ratio`` of both thresholds
(hysteresis: it does not flap at the threshold).

Memory is bounded: at most ``max_keys`` directories are tracked; past that the coldest are forgotten.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from cachefs.base.config import ClusterConfig, parse_size

__all__ = ["HOT_HEADER", "HeatTracker", "HotKey", "hot_bytes_per_s"]

#: Answer header: the directory is hot, spread over this many extra holders.
HOT_HEADER = "X-Cachefs-Hot"


@dataclass(frozen=True)
class HotKey:
    """A hot directory: its dataset id and path, replicas added, and the rates that made it hot (this member's
    share and the group-wide estimate)."""

    dataset: str
    directory: str
    replicas: int
    requests_per_s: float
    bytes_per_s: float
    group_requests_per_s: float
    group_bytes_per_s: float

    def to_json(self) -> dict:
        return {"dataset": self.dataset, "directory": self.directory, "replicas": self.replicas,
                "requests_per_s": round(self.requests_per_s, 2), "bytes_per_s": round(self.bytes_per_s),
                "group_requests_per_s": round(self.group_requests_per_s, 2),
                "group_bytes_per_s": round(self.group_bytes_per_s)}


class _Heat:
    __slots__ = ("at", "bytes", "hot", "requests")

    def __init__(self, at: float) -> None:
        self.requests = self.bytes = 0.0
        self.at = at
        self.hot = 0


class HeatTracker:
    """Rates per directory and which are hot. Not thread-safe: one event loop notes and reads."""

    def __init__(self, *, hot_requests: float, hot_bytes: float, replicas: int, tau: float = 10.0,
                 cool_ratio: float = 0.5, max_keys: int = 4096, clock=time.monotonic) -> None:
        if hot_requests <= 0 or hot_bytes <= 0 or tau <= 0 or not 0 < cool_ratio < 1 or replicas < 0:
            raise ValueError("heat: thresholds and tau must be positive, 0 < cool_ratio < 1, replicas >= 0")
        self.hot_requests, self.hot_bytes, self.replicas = hot_requests, hot_bytes, replicas
        self.tau, self.cool_ratio, self.max_keys, self.clock = tau, cool_ratio, max_keys, clock
        self._keys: dict[tuple[str, str], _Heat] = {}
        #: Answers given and their bytes, since start.
        self.served_requests = 0
        self.served_bytes = 0

    def _decayed(self, h: _Heat, now: float) -> None:
        if now > h.at:
            d = math.exp(-(now - h.at) / self.tau)
            h.requests *= d
            h.bytes *= d
            h.at = now

    def note(self, dataset: str, directory: str, nbytes: int) -> int:
        """Count one answer of ``nbytes`` for a file of ``directory``; returns the replicas its keys have now
        (0: not hot)."""
        self.served_requests += 1
        self.served_bytes += nbytes
        now = self.clock()
        key = (dataset, directory)
        h = self._keys.get(key)
        if h is None:
            if len(self._keys) >= self.max_keys:
                self._forget_coldest(now)
            h = self._keys[key] = _Heat(now)
        self._decayed(h, now)
        h.requests += 1.0
        h.bytes += nbytes
        if not h.hot:
            req, byt = h.requests / self.tau, h.bytes / self.tau
            if self.replicas and (req > self.hot_requests or byt > self.hot_bytes):
                h.hot = self.replicas
        elif self._cooled(h):
            h.hot = 0
        return h.hot

    def _cooled(self, h: _Heat) -> bool:
        """Whether a hot key's group-wide rate (this member's share × the holders) fell under the cool threshold."""
        spread = 1 + h.hot
        return (h.requests / self.tau * spread < self.cool_ratio * self.hot_requests
                and h.bytes / self.tau * spread < self.cool_ratio * self.hot_bytes)

    def replicas_of(self, dataset: str, directory: str) -> int:
        h = self._keys.get((dataset, directory))
        return h.hot if h is not None else 0

    def hot(self) -> list[HotKey]:
        """The hot directories now, busiest first (a directory nobody asks for any more cools here too)."""
        now = self.clock()
        out = []
        for (ds, d), h in self._keys.items():
            if not h.hot:
                continue
            self._decayed(h, now)
            if self._cooled(h):
                h.hot = 0
                continue
            spread = 1 + h.hot
            req, byt = h.requests / self.tau, h.bytes / self.tau
            out.append(HotKey(ds, d, h.hot, req, byt, req * spread, byt * spread))
        return sorted(out, key=lambda k: -k.group_bytes_per_s)

    def _forget_coldest(self, now: float) -> None:
        for h in self._keys.values():
            self._decayed(h, now)
        keep = sorted(self._keys.items(), key=lambda kv: -kv[1].requests)[: self.max_keys * 3 // 4]
        self._keys = dict(keep)


def hot_bytes_per_s(cluster: ClusterConfig, net_dir: str = "/sys/class/net") -> int:
    """``cluster.hot_bytes_per_s`` in bytes/s; unset, a quarter of the fastest NIC's speed (10 Gbit/s when no NIC
    says: veth and some virtual NICs report none)."""
    if cluster.hot_bytes_per_s:
        return parse_size(cluster.hot_bytes_per_s, "cluster.hot_bytes_per_s")
    best = 0
    try:
        names = os.listdir(net_dir)
    except OSError:
        names = []
    for name in names:
        if name == "lo":
            continue
        try:
            with open(os.path.join(net_dir, name, "speed")) as f:
                best = max(best, int(f.read().strip()))  # Mbit/s; -1 when unknown
        except (OSError, ValueError):
            continue
    mbit = best if best > 0 else 10_000
    return mbit * 1_000_000 // 8 // 4

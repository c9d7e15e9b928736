"""Orders computed from a declared sampler: what a job will read each epoch, without the job's code.

A job whose sampler is known by name need not publish its orders (:mod:`cachefs.prefetch.publish`): the mount (or
``cachefs order --sampler``) computes them. ``torch-distributed`` is PyTorch's ``DistributedSampler`` over a
dataset whose index ``i`` reads the ``i``-th of its files in path order (``ImageFolder`` over one level of class
directories does): ``torch.randperm(n)`` seeded with ``seed + epoch``, padded to a multiple of the world size
(or cut, with ``drop-last``), then every ``world_size``-th index from ``rank``. ``torch.randperm`` on the CPU is
a Fisher-Yates shuffle driven by a 32-bit Mersenne Twister seeded as numpy's legacy ``RandomState`` seeds its
own, so numpy gives the same permutation; tests/loaders compares it with torch's sampler.

A spec reads ``torch-distributed:seed=0,world-size=8,ranks=0-7,under=train,match=*.JPEG`` (every key optional):
``ranks`` are the ranks this node reads (one pod with eight GPUs: 0-7), ``under`` the dataset's directory whose
files are the samples, ``match`` a glob their names match, ``start-epoch`` the epoch the job starts at (a
restarted job: its checkpoint's), ``shuffle``/``drop-last`` as in the sampler.

:class:`SamplerPublisher` keeps the orders one epoch ahead on a mount: it publishes each rank's order for the start
epoch, and the next epoch's as soon as that rank's reader reaches the end of the current one.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from cachefs.base.errors import ConfigError
from cachefs.index.orders import list_orders, read_order, write_order
from cachefs.prefetch.orders import OrderBook

__all__ = ["SAMPLERS", "SamplerPublisher", "SamplerSpec", "distributed_indices", "parse_sampler", "sampler_files",
           "sampler_orders", "torch_randperm"]

log = logging.getLogger(__name__)

#: The samplers a spec may name.
SAMPLERS = ("torch-distributed",)
#: torch.randperm switches to 64-bit draws from here on; orders that long are not computed.
_MAX_SAMPLES = (1 << 32) // 20


@dataclass(frozen=True)
class SamplerSpec:
    """A declared sampler (see the module)."""

    kind: str = "torch-distributed"
    seed: int = 0
    world_size: int = 1
    ranks: tuple[int, ...] = (0,)
    shuffle: bool = True
    drop_last: bool = False
    under: str = ""
    match: str = "*"
    start_epoch: int = 0

    def publisher(self, rank: int) -> str:
        """The name its orders for ``rank`` are published under."""
        return f"sampler-r{rank}"


def parse_sampler(text: str) -> SamplerSpec:
    """A :class:`SamplerSpec` from ``KIND[:key=value,...]``; ConfigError naming what is wrong."""
    kind, _, rest = text.strip().partition(":")
    if kind not in SAMPLERS:
        raise ConfigError(f"sampler {kind!r}: known samplers are {', '.join(SAMPLERS)}")
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise ConfigError(f"sampler option {item!r}: write key=value")
        values[key.strip()] = value.strip()

    def whole(key: str, default: str) -> int:
        raw = values.pop(key, default)
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"sampler {text!r}: {key} must be a whole number, not {raw!r}") from None

    try:
        spec = SamplerSpec(
            kind=kind,
            seed=whole("seed", "0"),
            world_size=whole("world-size", "1"),
            ranks=_ranks(values.pop("ranks", values.pop("rank", "0"))),
            shuffle=_flag(values.pop("shuffle", "true")),
            drop_last=_flag(values.pop("drop-last", "false")),
            under=values.pop("under", "").strip("/"),
            match=values.pop("match", "*"),
            start_epoch=whole("start-epoch", "0"),
        )
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"sampler {text!r}: {exc}") from None
    if values:
        raise ConfigError(f"sampler {text!r}: unknown option(s) {', '.join(sorted(values))}")
    if spec.world_size < 1 or not 0 <= spec.seed < 1 << 63 or spec.start_epoch < 0:
        raise ConfigError(f"sampler {text!r}: world-size must be at least 1, seed and start-epoch 0 or more")
    if any(not 0 <= r < spec.world_size for r in spec.ranks):
        raise ConfigError(f"sampler {text!r}: ranks must be below world-size ({spec.world_size})")
    return spec


def _ranks(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split("+"):
        lo, dash, hi = part.partition("-")
        out += range(int(lo), int(hi) + 1) if dash else [int(lo)]
    if not out:
        raise ValueError("no ranks")
    return tuple(sorted(set(out)))


def _flag(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{text!r} is not true or false")


def torch_randperm(n: int, seed: int) -> list[int]:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()``, without torch."""
    import numpy as np

    if n > _MAX_SAMPLES:
        raise ConfigError(f"a sampler over {n} samples: at most {_MAX_SAMPLES} are supported")
    # torch seeds its mt19937 with the low 32 bits of the seed, as RandomState(int) does; bounded draws of the
    # full 32-bit range are the generator's raw outputs.
    draws = np.random.RandomState(seed & 0xFFFFFFFF).randint(0, 1 << 32, size=max(n - 1, 0), dtype=np.uint64)
    perm = list(range(n))
    for i, draw in enumerate(draws.tolist()):
        j = i + draw % (n - i)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def distributed_indices(n: int, epoch: int, spec: SamplerSpec, rank: int) -> list[int]:
    """The indices ``DistributedSampler(dataset of n, num_replicas, rank, shuffle, seed, drop_last)`` yields after
    ``set_epoch(epoch)``."""
    world = spec.world_size
    if spec.drop_last and n % world:
        per_rank = math.ceil((n - world) / world)
    else:
        per_rank = math.ceil(n / world)
    total = per_rank * world
    indices = torch_randperm(n, spec.seed + epoch) if spec.shuffle else list(range(n))
    if not spec.drop_last:
        pad = total - len(indices)
        if pad <= len(indices):
            indices += indices[:pad]
        elif indices:
            indices += (indices * math.ceil(pad / len(indices)))[:pad]
    else:
        indices = indices[:total]
    return indices[rank:total:world]


def sampler_files(paths: Iterable[str], spec: SamplerSpec, where: str | None = None) -> list[str]:
    """The samples in index order: the dataset's files under ``spec.under`` whose names match, by path. With
    ``where`` (the dataset, for the message), none is a ConfigError."""
    prefix = spec.under + "/" if spec.under else ""
    files = sorted(p for p in paths if p.startswith(prefix) and fnmatch.fnmatchcase(posixpath.basename(p), spec.match))
    if not files and where is not None:
        raise ConfigError(f"{where}: no file under {spec.under or '/'!r} matches {spec.match!r}")
    return files


def sampler_orders(files: list[str], spec: SamplerSpec, epoch: int) -> dict[int, list[str]]:
    """Each of the spec's ranks' order of ``files`` (index order) in ``epoch``."""
    return {rank: [files[i] for i in distributed_indices(len(files), epoch, spec, rank)] for rank in spec.ranks}


class SamplerPublisher:
    """Publishes a declared sampler's orders on this node, one epoch ahead of its readers (see the module).

    ``files``: the samples in index order (:func:`sampler_files`). :meth:`tick` is called every second or so by the
    process whose readers the orders are for (the mount's daemon): that is where ``book`` sees them move."""

    def __init__(self, spec: SamplerSpec, cache_dir: str, ds_id: str, url: str, files: list[str],
                 book: OrderBook) -> None:
        if not files:
            raise ConfigError(f"{url}: no file under {spec.under or '/'!r} matches {spec.match!r}")
        self.spec, self.cache_dir, self.ds_id, self.url, self.files, self.book = spec, cache_dir, ds_id, url, files, book
        self.epoch: dict[int, int] = {}

    def start(self) -> None:
        """Publish each rank's order for the epoch it is at: the start epoch, or (a daemon started again) the one
        its last order was for."""
        published = {}
        for f in list_orders(self.cache_dir, self.ds_id):
            got = read_order(f.path)
            if got is not None and got[0] is not None:
                published[f.publisher] = got[0]
        for rank in self.spec.ranks:
            epoch = published.get(self.spec.publisher(rank))
            if epoch is None or epoch < self.spec.start_epoch:
                self._publish(rank, self.spec.start_epoch)
            else:
                self.epoch[rank] = epoch

    def tick(self) -> None:
        """Publish the next epoch's order of every rank whose reader has reached the end of its current one."""
        shown = {o["publisher"]: o for o in self.book.orders(self.ds_id)}
        for rank, epoch in list(self.epoch.items()):
            o = shown.get(self.spec.publisher(rank))
            if o is None or o["epoch"] != epoch:
                continue
            # (DataLoader workers open a little out of order: the last few files may come before others)
            if o["reached"] >= o["files"] - min(8, o["files"] // 16 + 1):
                self._publish(rank, epoch + 1)

    def _publish(self, rank: int, epoch: int) -> None:
        paths = [self.files[i] for i in distributed_indices(len(self.files), epoch, self.spec, rank)]
        write_order(self.cache_dir, self.ds_id, self.url, paths, epoch=epoch, publisher=self.spec.publisher(rank))
        self.book.reread(self.ds_id)  # (its readers may start on it within the second the book would wait)
        self.epoch[rank] = epoch
        log.info("%s: published rank %d's order for epoch %d (%d files)", self.url, rank, epoch, len(paths))

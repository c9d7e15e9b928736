"""PyTorch helpers (torch itself is not needed to import this module: a sampler is any iterable of indices).

:class:`PublishingSampler` wraps the sampler a ``DataLoader`` uses (``DistributedSampler`` included) and publishes
each epoch's order before yielding it (:func:`cachefs.publish_order`): the node's cache then fetches what the
loader's workers open next ahead of them, in that order. The order the model sees is the wrapped sampler's,
unchanged.

    sampler = PublishingSampler(DistributedSampler(ds, shuffle=True), paths, dataset="/mnt/imagenet")
    loader = DataLoader(ds, sampler=sampler, num_workers=8)
    for epoch in range(n):
        sampler.set_epoch(epoch)
        for batch in loader: ...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from cachefs.prefetch.publish import default_publisher, publish_order

__all__ = ["CacheAwareSampler", "PublishingSampler", "resident_under"]


class _Wrapping:
    """A sampler over another: its length, its epoch (passed on), and the path of each index."""

    def __init__(self, sampler: Iterable[int], paths: Sequence[str] | Callable[[int], str]) -> None:
        self.sampler = sampler
        self.path_of = paths if callable(paths) else paths.__getitem__
        self.epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


class PublishingSampler(_Wrapping):
    """A sampler that publishes the order of the sampler it wraps, epoch by epoch.

    ``paths``: the file each index reads (a sequence, or a function of the index), relative to the dataset's root
    or under its mount point. ``dataset``: the dataset's URL or mount point. ``publish_options``: passed to
    :func:`cachefs.publish_order` (``cache_dir=`` for a cache directory other than the default).
    """

    def __init__(self, sampler: Iterable[int], paths: Sequence[str] | Callable[[int], str], *, dataset: str,
                 **publish_options: Any) -> None:
        super().__init__(sampler, paths)
        self.dataset = dataset
        self.publish_options = publish_options
        self.publish_options.setdefault("publisher", default_publisher())

    def __iter__(self) -> Iterator[int]:
        order = list(iter(self.sampler))
        publish_order(self.dataset, [self.path_of(i) for i in order], epoch=self.epoch, **self.publish_options)
        return iter(order)


def resident_under(mountpoint: str) -> Callable[[str], bool]:
    """Whether a file under a cachefs mount is wholly cached on this node (its ``user.cachefs.cached`` extended
    attribute against its size); a path relative to the mount point, or under it."""

    def resident(path: str) -> bool:
        full = path if os.path.isabs(path) else os.path.join(mountpoint, path)
        try:
            return int(os.getxattr(full, "user.cachefs.cached")) >= os.stat(full).st_size
        except (OSError, ValueError):
            return False

    return resident


class CacheAwareSampler(_Wrapping):
    """Opt-in, and off by default because **it changes the order the model sees**: each epoch's order of the
    wrapped sampler is cut into windows of ``window`` samples, and within each window the samples already cached
    on this node come first (in their order), then the rest (in theirs). Every sample is still seen exactly once
    per epoch, and no sample moves by more than ``window`` places, so the shuffle stays a shuffle at that scale
    (the substitution Quiver and Seneca make for cache-resident data). With a cache holding part of the
    dataset, the reads the job waits on at the start of each window are hits, while what misses is fetched (and,
    with ``publish``, fetched ahead in the new order).

    ``resident(path)``: whether a file is cached here (:func:`resident_under` a mount point, or your own).
    ``publish``: options for :func:`cachefs.publish_order` (``dataset=`` and any others) to publish each epoch's
    reordered order too.
    """

    def __init__(self, sampler: Iterable[int], paths: Sequence[str] | Callable[[int], str], *,
                 resident: Callable[[str], bool], window: int = 1024, publish: dict[str, Any] | None = None) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        super().__init__(sampler, paths)
        self.resident, self.window = resident, window
        self.publish = dict(publish) if publish else None
        if self.publish is not None:
            self.publish.setdefault("publisher", default_publisher())

    def __iter__(self) -> Iterator[int]:
        base = list(iter(self.sampler))
        order: list[int] = []
        for start in range(0, len(base), self.window):
            chunk = base[start:start + self.window]
            here = [self.resident(self.path_of(i)) for i in chunk]
            order += [i for i, h in zip(chunk, here, strict=True) if h]
            order += [i for i, h in zip(chunk, here, strict=True) if not h]
        if self.publish is not None:
            options = dict(self.publish)
            dataset = options.pop("dataset")
            publish_order(dataset, [self.path_of(i) for i in order], epoch=self.epoch, **options)
        return iter(order)

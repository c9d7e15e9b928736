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

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from cachefs.prefetch.publish import default_publisher, publish_order

__all__ = ["PublishingSampler"]


class PublishingSampler:
    """A sampler that publishes the order of the sampler it wraps, epoch by epoch.

    ``paths``: the file each index reads (a sequence, or a function of the index), relative to the dataset's root
    or under its mount point. ``dataset``: the dataset's URL or mount point. ``publish_options``: passed to
    :func:`cachefs.publish_order` (``cache_dir=`` for a cache directory other than the default).
    """

    def __init__(self, sampler: Iterable[int], paths: Sequence[str] | Callable[[int], str], *, dataset: str,
                 **publish_options: Any) -> None:
        self.sampler = sampler
        self.path_of = paths if callable(paths) else paths.__getitem__
        self.dataset = dataset
        self.publish_options = publish_options
        self.publish_options.setdefault("publisher", default_publisher())
        self.epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        order = list(iter(self.sampler))
        publish_order(self.dataset, [self.path_of(i) for i in order], epoch=self.epoch, **self.publish_options)
        return iter(order)

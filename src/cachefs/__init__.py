"""cachefs: a node-local read-through cache for datasets on object storage.

``cachefs.publish_order(dataset, paths, ...)`` tells the node's cache the order a job will read a dataset in
(:func:`cachefs.prefetch.publish.publish_order`); ``cachefs.torch`` wraps a PyTorch sampler to publish each epoch's."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["publish_order"]


def __getattr__(name: str) -> Any:
    if name == "publish_order":  # (imported on first use: `import cachefs` stays light)
        from cachefs.prefetch.publish import publish_order

        return publish_order
    raise AttributeError(f"module 'cachefs' has no attribute {name!r}")

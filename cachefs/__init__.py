"""cachefs: a node-local read-through cache for datasets on object storage."""

__version__ = "0.1.0"

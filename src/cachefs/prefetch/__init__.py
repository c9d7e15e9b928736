"""Fetching ahead of readers: the read-ahead plans (pure), directory read-ahead's state, and the prefetcher that
runs what the read paths hand it with spare memory only."""

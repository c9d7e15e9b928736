"""Test kit shipped with cachefs: a local S3 server, a fault-injecting source, conformance suites.

Nothing in the ``cachefs`` package imports this; tests, benchmarks and ``cachefs demo`` do.
"""

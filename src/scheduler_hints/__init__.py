"""Scheduler hints: cache-locality labels and the kube-scheduler extender."""

"""cachefs removed from the node while a pod reads (the last test of the tier: it deletes the node DaemonSet, and
deploys it again at the end). With no next node pod to take its sessions, the old one serves on until the pods using
them end, then unmounts them and goes: the reader sees no error, and nothing is left mounted on the host."""

from __future__ import annotations

import os

from .cluster import mounts_under
from .conftest import REPORT
from .test_3_faults import assert_unharmed, cold_dataset, reader_result, stale_mounts, start_reader


def test_the_daemonset_deleted_under_a_reading_pod_serves_it_to_the_end_and_leaves_nothing(cluster):
    url, want = cold_dataset(cluster, "removal")
    start_reader(cluster, "removal", url, want)
    cluster.kubectl("delete", "daemonset", "cachefs-node", "-n", "cachefs-system", "--wait=false")
    result = reader_result(cluster, "removal")
    uid = cluster.get("pod", "removal")["metadata"]["uid"]
    cluster.delete_pod("removal")
    cluster.wait(lambda: not os.path.exists(f"/var/lib/kubelet/pods/{uid}"), "the reader's directory removed", 120)

    def node_pods() -> list[str]:
        return cluster.kubectl("get", "pods", "-n", "cachefs-system", "-l", "app.kubernetes.io/component=node",
                               "-o", "name").split()

    cluster.wait(lambda: not node_pods(), "the node pod gone", 240)
    result["left_mounted"] = [m for m in mounts_under("/var/lib/kubelet/pods") if "kubernetes.io~csi" in m] + \
        mounts_under("/var/lib/cachefs/csi/sessions")
    result["stale"] = stale_mounts()
    REPORT["node DaemonSet deleted under a reading pod"] = (
        f"errors {result['errors']}, wrong {result['wrong']}, longest wait {result['max_wait_s']:.1f} s, left "
        f"mounted {len(result['left_mounted'])}, stale {len(result['stale'])}")
    try:
        assert_unharmed(result)
    finally:  # as it was, for whatever runs after (the example class as deploy/ has it: its parameters are fixed)
        cluster.kubectl("delete", "storageclass", "cachefs-example", "--ignore-not-found")
        cluster.deploy()

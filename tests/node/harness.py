"""The node tier's cluster as its tests use it: the control plane, the node, an S3 origin the node's pods reach (moto,
on the node's bridge address), deploy/ applied with kubectl through the tier's overlays, and helpers to run pods and
read what they printed.

Times the tier reports (printed at the end of the run, conftest.py) are collected in ``times``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import tempfile
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cachefs.testing.s3server import CREDENTIALS, S3Server
from tests.e2e.controlplane import REPO, ControlPlaneError

from .cluster import NODE_IP, NODE_NAME, Node, NodeControlPlane

HERE = Path(__file__).resolve().parent
IMAGE = "localhost/cachefs:0.1.0"
#: A second build of it (tests/node/build.sh), for the upgrade by `kubectl set image`.
NEXT_IMAGE = "localhost/cachefs:0.1.0-next"
BUCKET = "example-bucket"
#: The example StorageClass's dataset (deploy/base/storageclass.yaml): the tier's origin holds one there.
DATASET_PREFIX = "imagenet"
#: README labels the node with a cache group after deploying (docs/CLUSTER.md).
CACHE_GROUP = "rack-a"


def build() -> tuple[Path, Path, float]:
    """Build (or reuse) what the tier runs: ``(Kubernetes binaries, node cache, seconds)``."""
    t0 = time.monotonic()
    proc = subprocess.run([str(HERE / "build.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ControlPlaneError(f"tests/node/build.sh failed:\n{proc.stderr[-4000:]}")
    out = Path(proc.stdout.strip().splitlines()[-1])
    return Path((out / "k8s-bins").read_text().strip()), out, time.monotonic() - t0


def sample_dataset(seed: int = 7) -> dict[str, bytes]:
    """An ImageNet-shaped sample: small files in class directories, and a few larger ones (several blocks)."""
    rng = random.Random(seed)
    files = {f"train/n{c:08d}/img_{i:04d}.JPEG": rng.randbytes(rng.randint(2_000, 120_000))
             for c in range(4) for i in range(40)}
    files.update({f"val/shard-{i}.tar": rng.randbytes(9_000_000 + i * 1_234_567) for i in range(2)})
    return files


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class NodeCluster:
    k8s_bins: Path
    node_cache: Path
    workdir: Path
    times: dict[str, float] = field(default_factory=dict)

    def start(self) -> NodeCluster:
        self.node = Node(self.k8s_bins, sorted((self.node_cache / "images").glob("*.tar")), self.workdir / "node")
        self.node.workdir.mkdir(parents=True)
        self.node.prepare_host()
        self.cp = NodeControlPlane(self.k8s_bins, self.workdir / "cp")
        self.cp.workdir.mkdir(parents=True)
        self.cp.start()
        self.kubeconfig = self.cp.admin_kubeconfig
        self.node.start(self.cp)
        self.times["images imported into containerd"] = self.node.image_import_s
        self.times["node Ready (runtime, images, kube-proxy, kubelet)"] = self.node.ready_s
        self.s3 = S3Server(host=NODE_IP, fast=True).start()
        self.s3_client = self.s3.client()
        self.s3_client.create_bucket(Bucket=BUCKET)
        self.dataset = sample_dataset()
        for rel, data in self.dataset.items():
            self.s3_client.put_object(Bucket=BUCKET, Key=f"{DATASET_PREFIX}/{rel}", Body=data)
        return self

    def stop(self) -> None:
        for part in ("node", "s3", "cp"):
            obj = getattr(self, part, None)
            if obj is not None:
                try:
                    obj.stop()
                except Exception as exc:  # noqa: BLE001 - the rest must still go
                    print(f"stopping {part}: {exc}")

    # -- kubectl ----------------------------------------------------------------------------------------------
    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        proc = subprocess.run([str(self.k8s_bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def apply(self, *docs: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    def get(self, kind: str, name: str, namespace: str = "default") -> dict:
        return json.loads(self.kubectl("get", kind, name, "-n", namespace, "-o", "json"))

    def exists(self, kind: str, name: str, namespace: str = "default") -> bool:
        return bool(self.kubectl("get", kind, name, "-n", namespace, "--ignore-not-found", "-o", "name"))

    def wait(self, check, what: str, timeout: float = 180, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
                if last:
                    return last
            except (ControlPlaneError, urllib.error.URLError, KeyError) as exc:
                last = exc
            time.sleep(interval)
        raise AssertionError(f"not {what} after {timeout:g}s (last: {last!r})\n{self.describe_failure()}")

    def describe_failure(self) -> str:
        """What a failed wait needs: the pods, recent events, the node pod's containers' last log lines."""
        out = [self.kubectl("get", "pods", "-A", "-o", "wide", check=False)]
        out.append(self.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False)[-4000:])
        for container in ("mounter", "csi", "agent"):
            out.append(f"--- cachefs-node/{container}\n" + self.kubectl(
                "logs", "-n", "cachefs-system", "daemonset/cachefs-node", "-c", container, "--tail=30",
                check=False))
        out.append("--- kubelet\n" + "\n".join(self.node.log("kubelet").splitlines()[-30:]))
        return "\n".join(out)

    def wait_rollout(self, kind: str, name: str, namespace: str = "cachefs-system", timeout: float = 300) -> float:
        """Wait until every pod of a DaemonSet or Deployment is up to date and ready; returns the seconds waited.
        (``kubectl rollout status`` refuses DaemonSets whose updateStrategy is OnDelete.)"""
        t0 = time.monotonic()

        def done() -> bool:
            obj = self.get(kind, name, namespace)
            st, gen = obj.get("status", {}), obj["metadata"]["generation"]
            if st.get("observedGeneration") != gen:
                return False
            if kind == "daemonset":
                want = st.get("desiredNumberScheduled", 0)
                return want > 0 and st.get("numberReady") == want and st.get("updatedNumberScheduled") == want
            want = obj["spec"].get("replicas", 1)
            return st.get("readyReplicas") == want and st.get("updatedReplicas") == want

        self.wait(done, f"{kind}/{name} ready", timeout, interval=0.5)
        return time.monotonic() - t0

    # -- deploy/ ----------------------------------------------------------------------------------------------
    def deploy(self) -> None:
        """README's "On Kubernetes" commands, through the tier's overlays (image names only)."""
        self.kubectl("apply", "-k", str(HERE / "overlay" / "base"))
        self.kubectl("apply", "-k", str(HERE / "overlay" / "scheduler"))
        self.kubectl("label", "node", NODE_NAME, f"cachefs.io/cache-group={CACHE_GROUP}")
        self.times["cachefs-node DaemonSet Ready"] = self.wait_rollout("daemonset", "cachefs-node")
        self.wait_rollout("deployment", "cachefs-csi-controller")
        self.wait_rollout("deployment", "cachefs-scheduler")
        self.credentials_secret("default")

    def credentials_secret(self, namespace: str, name: str = "dataset-credentials") -> None:
        """The Secret the StorageClasses name for node publish (docs: awsAccessKeyID / awsSecretAccessKey)."""
        self.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
                    "stringData": {"awsAccessKeyID": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                   "awsSecretAccessKey": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}})

    def storage_class(self, name: str, url: str, *, writable: bool = False, source: Path | None = None) -> dict:
        """deploy/'s StorageClass edited as README says (url, endpointUrl/region, the credentials Secret)."""
        source = source or REPO / "deploy" / "base" / "storageclass.yaml"
        (sc,) = [d for d in yaml.safe_load_all(source.read_text()) if d and d["kind"] == "StorageClass"]
        sc["metadata"]["name"] = name
        sc["parameters"].update({"url": url, "endpointUrl": self.s3.endpoint, "region": CREDENTIALS["AWS_REGION"],
                                 "csi.storage.k8s.io/node-publish-secret-name": "dataset-credentials",
                                 "csi.storage.k8s.io/node-publish-secret-namespace": "default"})
        if writable:
            sc["parameters"]["writable"] = "true"
        if self.exists("storageclass", name, "default"):
            self.kubectl("delete", "storageclass", name)
        self.apply(sc)
        return sc

    # -- pods -------------------------------------------------------------------------------------------------
    def pod_phase(self, name: str, namespace: str = "default") -> str:
        return self.get("pod", name, namespace)["status"].get("phase", "")

    def wait_pod(self, name: str, phases: tuple[str, ...] = ("Running",), namespace: str = "default",
                 timeout: float = 180) -> str:
        return self.wait(lambda: (p := self.pod_phase(name, namespace)) in phases and p, f"pod {name} {phases}",
                         timeout)

    def logs(self, name: str, namespace: str = "default", container: str | None = None) -> str:
        args = ["logs", name, "-n", namespace] + (["-c", container] if container else [])
        return self.kubectl(*args)

    def delete_pod(self, name: str, namespace: str = "default", *, wait: bool = True, timeout: float = 180) -> None:
        self.kubectl("delete", "pod", name, "-n", namespace, "--ignore-not-found", f"--wait={str(wait).lower()}",
                     f"--timeout={int(timeout)}s", timeout=timeout + 30)


READ_SCRIPT = r"""
import hashlib, json, os, sys, time
root = sys.argv[1]
t0 = time.monotonic(); first = None; out = {}
for d, _, files in sorted(os.walk(root)):
    for name in sorted(files):
        p = os.path.join(d, name)
        with open(p, "rb") as f:
            data = f.read()
        if first is None:
            first = time.monotonic() - t0
        out[os.path.relpath(p, root)] = hashlib.sha256(data).hexdigest()
print(json.dumps({"files": out, "first_byte_s": first, "seconds": time.monotonic() - t0}), flush=True)
"""


def reader_pod(name: str, volume: dict, *, mount: str = "/data", script: str = READ_SCRIPT, args: tuple = ("/data",),
               security: dict | None = None, restart: str = "Never", namespace: str = "default",
               read_only: bool = True) -> dict:
    """A pod in the cachefs image that runs ``script`` (Python) over the volume mounted at ``mount``."""
    spec: dict[str, Any] = {
        "restartPolicy": restart, "terminationGracePeriodSeconds": 5,
        "containers": [{"name": "reader", "image": IMAGE, "imagePullPolicy": "Never",
                        "command": ["python3", "-c", script, *args],
                        "volumeMounts": [{"name": "data", "mountPath": mount, "readOnly": read_only}]}],
        "volumes": [{"name": "data", **volume}]}
    if security:
        spec["securityContext"] = security
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in the pod's output: {text[-2000:]!r}")


def temp_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="cachefs-node-"))


def environment_refusal() -> str | None:
    """Why this machine cannot run the node tier, or None."""
    if os.geteuid() != 0:
        return "the node tier needs root (kubelet, containerd, mounts)"
    if not os.path.exists("/dev/fuse"):
        return "the node tier needs /dev/fuse"
    for path in ("/run/containerd/containerd.sock", "/var/lib/kubelet/kubeconfig"):
        if os.path.exists(path) and subprocess.run(["pgrep", "-x", "containerd|kubelet"], capture_output=True).returncode == 0:
            return f"a container runtime or kubelet already runs here ({path}); the tier needs the node's paths"
    return None


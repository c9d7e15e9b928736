"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-scheduler and kube-controller-manager's
resourceclaim controller, built from Go modules
(``k8s-bins/build.sh``), started on loopback ports with generated certificates and keys, torn down with
every child process.

Authentication: a static token file with an admin (``system:masters``) token for the test itself and the
scheduler, and a token for the extender's service account (so the RBAC in ``deploy/`` is what authorises it);
service-account tokens minted through the TokenRequest API (bound to pods, as kubelet mounts them) work too,
since the API server signs them with a generated key.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ADMIN_TOKEN = "cachefs-e2e-admin"
EXTENDER_TOKEN = "cachefs-e2e-extender"
EXTENDER_USER = "system:serviceaccount:cachefs-system:cachefs-scheduler"  # the sidecar shares its pod's account


#: The extender's topology_wait in these tests (seconds).
EXTENDER_TOPOLOGY_WAIT = 15


class ControlPlaneError(RuntimeError):
    pass


def build_binaries() -> Path:
    """Build (or reuse) the binaries; raises with the build's own error output when it fails. ``make test`` builds
    them before the timed tests start (tests/prepare.sh); without them and without Go to build them, the tests
    that need them skip."""
    import shutil

    import pytest

    if shutil.which("go") is None and subprocess.run([str(HERE / "k8s-bins" / "build.sh")],
                                                     capture_output=True).returncode != 0:
        pytest.skip("the Kubernetes components are not built and there is no Go toolchain to build them "
                    "(Go >= 1.26; tests/prepare.sh builds them)")
    proc = subprocess.run([str(HERE / "k8s-bins" / "build.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ControlPlaneError(f"building the Kubernetes components failed:\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "e2e", "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e"}}],
    }))
    return path


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)


@dataclass
class ControlPlane:
    bins: Path
    workdir: Path
    extender_port: int = field(default_factory=free_port)
    procs: dict[str, Proc] = field(default_factory=dict)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as f:
            popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        proc = Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def _wait(self, name: str, check, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].popen.poll() is not None:
                raise ControlPlaneError(f"{name} exited: {self.procs[name].log.read_text()[-3000:]}")
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise ControlPlaneError(f"{name} not ready after {timeout:g}s: {self.procs[name].log.read_text()[-3000:]}")

    def _start_etcd(self) -> int:
        """Start etcd on loopback; returns its client port."""
        w = self.workdir
        etcd_port, peer_port = free_port(), free_port()
        self._spawn("etcd", [
            str(self.bins / "etcd"), "--name=e2e", f"--data-dir={w / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}", f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=e2e=http://127.0.0.1:{peer_port}", "--unsafe-no-fsync=true", "--log-level=warn"])
        self._wait("etcd", lambda: urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=2).status == 200)
        return etcd_port

    def start(self) -> ControlPlane:
        w = self.workdir
        self.api_port, sched_port = free_port(), free_port()
        etcd_port = self._start_etcd()
        subprocess.run(["openssl", "genrsa", "-out", str(w / "sa.key"), "2048"], check=True, capture_output=True)
        (w / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},e2e-admin,e2e-admin,"system:masters"\n'
            f'{EXTENDER_TOKEN},{EXTENDER_USER},extender,'
            '"system:serviceaccounts,system:serviceaccounts:cachefs-system"\n')
        self.server = f"https://127.0.0.1:{self.api_port}"
        self._spawn("kube-apiserver", [
            str(self.bins / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--advertise-address=127.0.0.1", "--bind-address=127.0.0.1", f"--secure-port={self.api_port}",
            f"--cert-dir={w / 'pki'}", f"--service-account-issuer={self.server}",
            f"--service-account-key-file={w / 'sa.key'}", f"--service-account-signing-key-file={w / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true", "--authorization-mode=RBAC",
            f"--token-auth-file={w / 'tokens.csv'}",
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition,Priority",
            "--endpoint-reconciler-type=none", "--enable-priority-and-fairness=false"])
        self._wait("kube-apiserver", lambda: self.request("GET", "/readyz", raw=True) == b"ok")

        self.admin_kubeconfig = _kubeconfig(w / "admin.kubeconfig", self.server, ADMIN_TOKEN)
        self.extender_kubeconfig = _kubeconfig(w / "extender.kubeconfig", self.server, EXTENDER_TOKEN)
        sched = yaml.safe_load((REPO / "deploy" / "scheduler" / "kube-scheduler-config.yaml").read_text())
        sched["clientConnection"] = {"kubeconfig": str(self.admin_kubeconfig)}
        sched["leaderElection"] = {"leaderElect": False}
        sched["podInitialBackoffSeconds"] = 1
        sched["podMaxBackoffSeconds"] = 2
        for ext in sched["extenders"]:
            ext["urlPrefix"] = f"http://127.0.0.1:{self.extender_port}"
        (w / "scheduler.yaml").write_text(yaml.safe_dump(sched))
        self._spawn("kube-scheduler", [
            str(self.bins / "kube-scheduler"), f"--config={w / 'scheduler.yaml'}", "--bind-address=127.0.0.1",
            f"--secure-port={sched_port}", "--v=5"])  # 5: failed prioritize calls are logged
        self._wait("kube-scheduler", lambda: urllib.request.urlopen(
            f"https://127.0.0.1:{sched_port}/readyz", timeout=2, context=_no_verify()).status == 200)
        # Only the resourceclaim controller (it makes a pod's ResourceClaims from their templates, DRA) and the
        # garbage collector (it deletes them, owned by the pod, after the pod); every other controller stays off,
        # as the tests create what they need themselves.
        kcm_port = free_port()
        self._spawn("kube-controller-manager", [
            str(self.bins / "kube-controller-manager"), f"--kubeconfig={self.admin_kubeconfig}",
            "--controllers=resourceclaim-controller,garbage-collector-controller", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={kcm_port}", "--use-service-account-credentials=false"])
        self._wait("kube-controller-manager", lambda: urllib.request.urlopen(
            f"https://127.0.0.1:{kcm_port}/healthz", timeout=2, context=_no_verify()).status == 200)
        return self

    def start_extender(self) -> Proc:
        """Run ``cachefs scheduler-extender`` as its service account; returns once it answers /healthz."""
        cachefs = shutil.which("cachefs", path=os.path.dirname(sys.executable)) or "cachefs"
        config = self.workdir / "extender.yaml"
        # A shorter topology wait than the default 60 s, so that the gang test can outlast it (see there).
        config.write_text(f"topology_wait: {EXTENDER_TOPOLOGY_WAIT}\n")
        proc = self._spawn("extender", [cachefs, "scheduler-extender", f"--listen=127.0.0.1:{self.extender_port}",
                                        f"--kubeconfig={self.extender_kubeconfig}", f"--extender-config={config}",
                                        "-v"])
        self._wait("extender", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{self.extender_port}/healthz", timeout=2).status == 200)
        return proc

    def stop(self) -> None:
        """Stop every component and remove the work directory: its etcd data, service-account signing key and
        token file must not outlive the run (after a failure too; the logs a failure needs are in its
        message)."""
        try:
            for name in reversed(list(self.procs)):
                self.procs[name].stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- API helpers --------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, token: str = ADMIN_TOKEN, raw: bool = False,
                content_type: str = "application/json", accept: str | None = None) -> Any:
        req = urllib.request.Request(self.server + path, method=method,
                                     data=None if body is None else json.dumps(body).encode())
        req.add_header("Authorization", f"Bearer {token}")
        req.add_header("Content-Type", content_type)
        if accept:
            req.add_header("Accept", accept)
        with urllib.request.urlopen(req, timeout=30, context=_no_verify()) as resp:
            data = resp.read()
        return data if raw else json.loads(data or b"null")

    def apply(self, *docs: dict[str, Any]) -> None:
        """Create each object (kinds the tests and deploy/ use); unknown or duplicate fields are refused
        (strict field validation), as `kubectl apply --validate=strict` would."""
        for doc in docs:
            self.request("POST", collection_path(doc) + "?fieldValidation=Strict", doc)

    def apply_file(self, path: Path) -> None:
        self.apply(*[d for d in yaml.safe_load_all(path.read_text()) if d])

    def log(self, name: str) -> str:
        return self.procs[name].log.read_text(errors="replace")


_PATHS = {
    "Namespace": ("/api/v1", "namespaces", False), "Node": ("/api/v1", "nodes", False),
    "Pod": ("/api/v1", "pods", True), "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "PersistentVolume": ("/api/v1", "persistentvolumes", False),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Service": ("/api/v1", "services", True), "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "DaemonSet": ("/apis/apps/v1", "daemonsets", True), "Deployment": ("/apis/apps/v1", "deployments", True),
    "Job": ("/apis/batch/v1", "jobs", True),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "CSIDriver": ("/apis/storage.k8s.io/v1", "csidrivers", False),
    "StorageClass": ("/apis/storage.k8s.io/v1", "storageclasses", False),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "Topology": ("/apis/kueue.x-k8s.io/v1beta2", "topologies", False),
    "ResourceFlavor": ("/apis/kueue.x-k8s.io/v1beta2", "resourceflavors", False),
    "Workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads", True),
    "PodGroup": ("/apis/scheduling.run.ai/v2alpha2", "podgroups", True),
    "CacheDataset": ("/apis/cachefs.io/v1alpha1", "cachedatasets", True),
    "ResourceSlice": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "DeviceClass": ("/apis/resource.k8s.io/v1", "deviceclasses", False),
    "ResourceClaim": ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    "ResourceClaimTemplate": ("/apis/resource.k8s.io/v1", "resourceclaimtemplates", True),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    "ValidatingAdmissionPolicyBinding": ("/apis/admissionregistration.k8s.io/v1",
                                         "validatingadmissionpolicybindings", False),
}


def collection_path(doc: dict[str, Any]) -> str:
    base, plural, namespaced = _PATHS[doc["kind"]]
    if namespaced:
        return f"{base}/namespaces/{doc['metadata'].get('namespace', 'default')}/{plural}"
    return f"{base}/{plural}"


def _no_verify():
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def start_control_plane() -> ControlPlane:
    cp = ControlPlane(build_binaries(), Path(tempfile.mkdtemp(prefix="cachefs-k8s-")))
    try:
        return cp.start()
    except BaseException:
        cp.stop()
        raise

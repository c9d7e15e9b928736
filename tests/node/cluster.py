"""A real one-node Kubernetes cluster for the node tier: the control plane of tests/e2e (etcd, kube-apiserver,
kube-scheduler, kube-controller-manager, built from Go modules) configured as for real nodes, and one node on this
machine: containerd and runc from Debian's packages, CNI's bridge plugin, kube-proxy and kubelet built from the same
k8s.io/kubernetes module and version.

What differs from the e2e control plane, because a kubelet and pods use it:
- kube-apiserver listens on the node's bridge address (``NODE_IP``), where pods reach it through the ``kubernetes``
  Service (kube-proxy's rules) and kubelet directly; its certificate names that Service and address (pki.py);
- every admission plugin a cluster runs by default (ServiceAccount: pods get their API tokens) plus NodeRestriction,
  and the Node authorizer: kubelet acts as ``system:node:<name>``, kube-proxy as ``system:kube-proxy``;
- kube-controller-manager runs its default controllers (DaemonSets, Deployments, Jobs, PV binding, EndpointSlices,
  service accounts, the cluster CA's ConfigMap);
- a default kube-scheduler; the cachefs one is a pod of deploy/scheduler.

The node keeps kubelet's and containerd's default paths (deploy/'s host paths assume them): /var/lib/kubelet,
/var/lib/containerd, /run/containerd, /var/log/pods. :meth:`Node.stop` removes what the node made there, its mounts,
cgroups, network and firewall rules, so that nothing outlives the tier.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.e2e.controlplane import ADMIN_TOKEN, ControlPlane, ControlPlaneError, _kubeconfig, _no_verify, free_port

from .pki import Pki

NODE_NAME = "cachefs-node-0"
BRIDGE = "cachefs0"
NODE_IP = "10.244.0.1"
POD_CIDR = "10.244.0.0/24"
SERVICE_CIDR = "10.0.0.0/24"
KUBERNETES_SERVICE_IP = "10.0.0.1"
NODE_TOKEN = "cachefs-node-kubelet"
PROXY_TOKEN = "cachefs-node-kube-proxy"
CONTAINERD_SOCK = "/run/containerd/containerd.sock"

#: Paths the node writes that the tier removes after it (kubelet's and containerd's defaults).
NODE_DIRS = ("/var/lib/kubelet", "/var/lib/containerd", "/run/containerd", "/var/log/pods", "/var/log/containers",
             "/var/lib/cni", "/opt/containerd", "/usr/libexec/kubernetes", "/var/lib/cachefs", "/var/cache/cachefs")
#: Of them, the ones a node pod mounts with Bidirectional propagation: they must be shared mounts, as systemd makes
#: every mount on a usual node; on this machine / is private, so each is made a shared bind mount of itself.
SHARED_DIRS = ("/var/lib/kubelet", "/var/lib/cachefs")
#: The node's cache disk: a small tmpfs, so the tier can fill it (a node's NVMe mounted at the cache path).
CACHE_DIR = "/var/cache/cachefs"


def sh(*argv: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=timeout, **kw)


class NodeControlPlane(ControlPlane):
    """The e2e control plane as a cluster with a real node runs it (module docstring)."""

    def start(self) -> NodeControlPlane:
        w = self.workdir
        self.api_port, sched_port, kcm_port = free_port(), free_port(), free_port()
        etcd_port = self._start_etcd()
        self.pki = Pki(w / "pki")
        serving = self.pki.issue("apiserver", "kube-apiserver", server=True,
                                 ips=(NODE_IP, KUBERNETES_SERVICE_IP, "127.0.0.1"),
                                 dns=("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                      "kubernetes.default.svc.cluster.local", "localhost"))
        kubelet_client = self.pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                        org="system:masters")
        subprocess.run(["openssl", "genrsa", "-out", str(w / "sa.key"), "2048"], check=True, capture_output=True)
        (w / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},e2e-admin,e2e-admin,"system:masters"\n'
            f'{NODE_TOKEN},system:node:{NODE_NAME},kubelet,"system:nodes"\n'
            f'{PROXY_TOKEN},system:kube-proxy,kube-proxy\n')
        self.server = f"https://{NODE_IP}:{self.api_port}"
        self._spawn("kube-apiserver", [
            str(self.bins / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--advertise-address={NODE_IP}", f"--bind-address={NODE_IP}", f"--secure-port={self.api_port}",
            f"--tls-cert-file={serving[0]}", f"--tls-private-key-file={serving[1]}",
            f"--client-ca-file={self.pki.ca_file}",
            f"--kubelet-client-certificate={kubelet_client[0]}", f"--kubelet-client-key={kubelet_client[1]}",
            "--kubelet-preferred-address-types=InternalIP",
            "--service-account-issuer=https://kubernetes.default.svc", "--api-audiences=https://kubernetes.default.svc",
            f"--service-account-key-file={w / 'sa.key'}", f"--service-account-signing-key-file={w / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            "--authorization-mode=Node,RBAC", f"--token-auth-file={w / 'tokens.csv'}",
            "--enable-admission-plugins=NodeRestriction", "--enable-priority-and-fairness=false"])
        self._wait("kube-apiserver", lambda: self.request("GET", "/readyz", raw=True) == b"ok")
        self.admin_kubeconfig = _kubeconfig(w / "admin.kubeconfig", self.server, ADMIN_TOKEN)
        self._spawn("kube-scheduler", [
            str(self.bins / "kube-scheduler"), f"--kubeconfig={self.admin_kubeconfig}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={sched_port}"])
        self._wait("kube-scheduler", lambda: urllib.request.urlopen(
            f"https://127.0.0.1:{sched_port}/readyz", timeout=2, context=_no_verify()).status == 200)
        self._spawn("kube-controller-manager", [
            str(self.bins / "kube-controller-manager"), f"--kubeconfig={self.admin_kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={kcm_port}",
            "--use-service-account-credentials=false", f"--root-ca-file={self.pki.ca_file}",
            f"--service-account-private-key-file={w / 'sa.key'}", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allocate-node-cidrs=false", "--node-monitor-grace-period=60s"])
        self._wait("kube-controller-manager", lambda: urllib.request.urlopen(
            f"https://127.0.0.1:{kcm_port}/healthz", timeout=2, context=_no_verify()).status == 200)
        return self


def _cni_config() -> dict:
    return {"cniVersion": "1.0.0", "name": "cachefs-node", "plugins": [
        {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "loopback"}]}


def _containerd_config(workdir: Path) -> str:
    # containerd 1.6's CRI plugin. restrict_oom_score_adj: root here lacks CAP_SYS_RESOURCE, and without it every
    # sandbox fails in runc ("can't get final child's PID from pipe"), since kubelet asks for oom_score_adj -998.
    return f"""version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "{CONTAINERD_SOCK}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:3.10"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{workdir / 'cni'}"
"""


def _kubelet_config(pki: Pki) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # This machine mounts cgroup v1 (do not change the host's cgroups): kubelet warns and runs.
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCK}",
        "address": NODE_IP, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki.ca_file)}},
        "authorization": {"mode": "Webhook"},
        # The tier's disk and memory are shared with the build caches: evict nothing, collect no images.
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False, "resolvConf": "/etc/resolv.conf",
        "syncFrequency": "10s", "fileCheckFrequency": "5s",
    }


@dataclass
class Node:
    """One real node on this machine, registered as ``NODE_NAME``. ``start()``/``stop()``; the components are
    restartable one by one (:meth:`restart`) for the fault tests."""

    bins: Path
    images: list[Path]
    workdir: Path
    cache_size: str = "3g"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self, cp: NodeControlPlane) -> Node:
        """Start the node against ``cp`` (after :meth:`prepare_host`, which the control plane needs first: it
        listens on the node's bridge address)."""
        self.cp = cp
        t0 = time.monotonic()
        (self.workdir / "cni").mkdir(parents=True, exist_ok=True)
        (self.workdir / "cni" / "10-cachefs.conflist").write_text(json.dumps(_cni_config()))
        (self.workdir / "containerd.toml").write_text(_containerd_config(self.workdir))
        self.start_component("containerd")
        for image in self.images:
            sh("ctr", "-a", CONTAINERD_SOCK, "-n", "k8s.io", "images", "import", str(image), timeout=600)
        self.image_import_s = time.monotonic() - t0
        self.start_component("kube-proxy")
        self.start_component("kubelet")
        self.wait_ready()
        self.ready_s = time.monotonic() - t0
        return self

    def prepare_host(self) -> None:
        """The node's directories, shared mounts, cache disk and bridge."""
        made = [path for path in NODE_DIRS if not os.path.exists(path)]
        RECORD.write_text(json.dumps({"made": made}))
        for path in NODE_DIRS:
            os.makedirs(path, exist_ok=True)
        for path in SHARED_DIRS:
            sh("mount", "--bind", path, path)
            sh("mount", "--make-rshared", path)
        sh("mount", "-t", "tmpfs", "-o", f"size={self.cache_size},mode=0755", "cachefs-node-cache", CACHE_DIR)
        # The bridge exists before kube-apiserver binds its address (the CNI plugin adopts it for the pods).
        if sh("ip", "link", "show", BRIDGE, check=False).returncode != 0:
            sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "replace", f"{NODE_IP}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")

    def _argv(self, name: str) -> list[str]:
        w = self.workdir
        if name == "containerd":
            return ["containerd", f"--config={w / 'containerd.toml'}"]
        if name == "kube-proxy":
            kubeconfig = _kubeconfig(w / "kube-proxy.kubeconfig", self.cp.server, PROXY_TOKEN)
            return [str(self.bins / "kube-proxy"), f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
                    "--proxy-mode=iptables", f"--cluster-cidr={POD_CIDR}", "--conntrack-max-per-core=0",
                    f"--metrics-bind-address=127.0.0.1:{free_port()}", f"--healthz-bind-address=127.0.0.1:{free_port()}"]
        if name == "kubelet":
            kubeconfig = w / "kubelet.kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "node",
                "clusters": [{"name": "node", "cluster": {"server": self.cp.server,
                                                          "certificate-authority": str(self.cp.pki.ca_file)}}],
                "users": [{"name": "node", "user": {"token": NODE_TOKEN}}],
                "contexts": [{"name": "node", "context": {"cluster": "node", "user": "node"}}]}))
            (w / "kubelet.yaml").write_text(yaml.safe_dump(_kubelet_config(self.cp.pki)))
            return [str(self.bins / "kubelet"), f"--config={w / 'kubelet.yaml'}", f"--kubeconfig={kubeconfig}",
                    f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}", "--v=2"]
        raise KeyError(name)

    def start_component(self, name: str) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(self._argv(name), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()
        if name == "containerd":
            self._until(lambda: sh("ctr", "-a", CONTAINERD_SOCK, "version", check=False).returncode == 0,
                        "containerd answering", 60, name)

    def stop_component(self, name: str, *, kill: bool = False) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(9 if kill else 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def restart(self, name: str) -> None:
        """Stop a node component the way systemd's ``restart`` does (SIGTERM) and start it again."""
        self.stop_component(name)
        self.start_component(name)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def _until(self, check, what: str, timeout: float, component: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if component and self.procs[component].poll() is not None:
                raise ControlPlaneError(f"{component} exited: {self.log(component)[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                if check():
                    return
            time.sleep(0.5)
        raise ControlPlaneError(f"not {what} after {timeout:g}s; "
                                + (f"{component} said: {self.log(component)[-3000:]}" if component else ""))

    def wait_ready(self, timeout: float = 180) -> None:
        def ready() -> bool:
            node = self.cp.request("GET", f"/api/v1/nodes/{NODE_NAME}")
            return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
        self._until(ready, f"node {NODE_NAME} Ready", timeout, "kubelet")

    def stop(self) -> None:
        """Stop the node and remove everything it left on the host (runs after a failure too)."""
        for name in ("kubelet", "kube-proxy"):
            with contextlib.suppress(Exception):
                self.stop_component(name)
        clean_host(self.bins)
        for proc in self.procs.values():  # (ended by clean_host)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


#: What :meth:`Node.prepare_host` made, for :func:`clean_host` (also after a run that died without cleaning up).
RECORD = Path("/var/tmp/cachefs-node-tier.json")


def clean_host(bins: Path) -> None:
    """Remove every trace of a node on this machine: its processes, containers, mounts, directories, network,
    firewall rules and cgroups. Stateless (it reads :data:`RECORD`), so a tier that starts after a crashed one
    begins clean."""
    for pattern in (f"{bins}/kubelet", f"{bins}/kube-proxy"):
        subprocess.run(["pkill", "-9", "-f", pattern], check=False)
    if os.path.exists(CONTAINERD_SOCK):
        with contextlib.suppress(Exception):
            _remove_containers()
    subprocess.run(["pkill", "-x", "containerd"], check=False)
    time.sleep(0.5)
    subprocess.run(["pkill", "-9", "-x", "containerd"], check=False)
    subprocess.run(["pkill", "-9", "-f", "containerd-shim-runc-v2"], check=False)
    if (bins / "kube-proxy").exists():
        sh(str(bins / "kube-proxy"), "--cleanup", check=False)
    made = json.loads(RECORD.read_text()) if RECORD.exists() else {"made": []}
    _unmount_under(("/var/lib/kubelet", "/run/containerd", "/var/lib/containerd", "/var/lib/cachefs", CACHE_DIR,
                    "/run/netns/cni-"))
    for path in (*SHARED_DIRS, CACHE_DIR):
        while path in mounts_under(path):
            if subprocess.run(["umount", "-l", path], check=False, capture_output=True).returncode != 0:
                break
    for path in NODE_DIRS:
        if path in made["made"]:
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.isdir(path):  # a directory that was here before: only what the node put in it
            for entry in os.listdir(path):
                p = os.path.join(path, entry)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
    for netns in Path("/run/netns").glob("cni-*") if Path("/run/netns").is_dir() else []:
        subprocess.run(["ip", "netns", "delete", netns.name], check=False, capture_output=True)
    subprocess.run(["ip", "link", "delete", BRIDGE], check=False, capture_output=True)
    _remove_kube_chains()
    _remove_cgroups("kubepods")
    RECORD.unlink(missing_ok=True)


def _remove_kube_chains() -> None:
    """The firewall chains kubelet makes (KUBE-FIREWALL, its canaries); kube-proxy --cleanup removes its own."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            rules = sh(tool, "-t", table, "-S", check=False).stdout.splitlines()
            for rule in rules:
                if rule.startswith("-A ") and " -j KUBE-" in rule and not rule.split()[1].startswith("KUBE-"):
                    sh(tool, "-t", table, *shlex.split("-D" + rule[2:]), check=False)
            for rule in rules:
                if rule.startswith("-N KUBE-"):
                    sh(tool, "-t", table, "-F", rule.split()[1], check=False)
            for rule in rules:
                if rule.startswith("-N KUBE-"):
                    sh(tool, "-t", table, "-X", rule.split()[1], check=False)


def _remove_containers() -> None:
    """Every pod sandbox and container the node ran, stopped and removed through containerd."""
    ctr = ("ctr", "-a", CONTAINERD_SOCK, "-n", "k8s.io")
    for task in sh(*ctr, "tasks", "ls", "-q", check=False, timeout=30).stdout.split():
        sh(*ctr, "tasks", "kill", "-s", "SIGKILL", task, check=False, timeout=30)
    deadline = time.monotonic() + 30
    while (tasks := sh(*ctr, "tasks", "ls", "-q", check=False, timeout=30).stdout.split()) and time.monotonic() < deadline:
        for task in tasks:
            sh(*ctr, "tasks", "delete", "-f", task, check=False, timeout=30)
        time.sleep(0.5)
    for container in sh(*ctr, "containers", "ls", "-q", check=False, timeout=30).stdout.split():
        sh(*ctr, "containers", "delete", container, check=False, timeout=30)


def _unmount_under(prefixes: tuple[str, ...]) -> None:
    for _ in range(5):
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        left = sorted({p for p in points if any(p.startswith(x) and p != x.rstrip("/") for x in prefixes)},
                      key=len, reverse=True)
        if not left:
            return
        for p in left:
            subprocess.run(["umount", "-l", p], check=False, capture_output=True)


def mounts_under(prefix: str) -> list[str]:
    """Mount points on the host at or under ``prefix`` (the tier's 'nothing stale is left' checks)."""
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]


def _remove_cgroups(name: str) -> None:
    root = Path("/sys/fs/cgroup")
    for controller in root.iterdir() if root.is_dir() else []:
        top = controller / name
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()

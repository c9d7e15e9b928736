"""The scheduler extender binds pods with its own rights, so nobody but kube-scheduler may reach it: by default it
listens on loopback only (a sidecar of kube-scheduler), and anywhere else it requires kube-scheduler's client
certificate. Tried for real: another network namespace, TLS clients with and without a certificate."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_extender(*extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", "scheduler-extender", "--standalone", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(check, proc, what: str) -> None:
    deadline = time.time() + 30
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        assert proc.poll() is None, f"{what} exited: {proc.communicate()[1]}"
        assert time.time() < deadline, f"{what} did not start"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    return proc.communicate(timeout=10)[1]


def test_listening_beyond_loopback_without_client_certificates_is_refused_at_start():
    for listen in ("0.0.0.0:18997", "[::]:18997", "10.0.0.1:18997"):
        out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "scheduler-extender", "--standalone",
                              "--listen", listen], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "loopback" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "scheduler-extender", "--standalone",
                          "--listen", "0.0.0.0:18997", "--tls-cert", "/nonexistent"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "go together" in out.stderr


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: (namespace, the host side's address)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2")
    name, host_if = f"cfs-sec-{os.getpid()}", f"cfsh{os.getpid() % 100000}"
    octet = os.getpid() % 250 + 1
    host_ip, ns_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)
    run("ip", "netns", "add", name)
    try:
        run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", name)
        run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        run("ip", "link", "set", host_if, "up")
        run("ip", "-n", name, "addr", "add", f"{ns_ip}/30", "dev", "eth0")
        run("ip", "-n", name, "link", "set", "eth0", "up")
        yield name, host_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def connect_from(ns: str, host: str, port: int) -> str:
    code = (f"import socket\ntry:\n    socket.create_connection(({host!r}, {port}), timeout=5).close(); print('connected')\n"
            "except OSError as e:\n    print(type(e).__name__)")
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_another_network_namespace_cannot_reach_the_extender(netns):
    ns, host_ip = netns
    port = free_port()
    proc = start_extender("--listen", f"127.0.0.1:{port}")
    try:
        wait_until(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).status == 200,
                   proc, "extender")
        assert connect_from(ns, host_ip, port) == "ConnectionRefusedError"
        # the check can fail: a socket listening on every address of this host is reached from there
        with socket.socket() as control:
            control.bind(("0.0.0.0", 0))
            control.listen()
            assert connect_from(ns, host_ip, control.getsockname()[1]) == "connected"
    finally:
        stop(proc)


def make_pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate from it, and one from another CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(cn, issuer=None, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        builder = (x509.CertificateBuilder().subject_name(name)
                   .issuer_name(issuer[0].subject if issuer else name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
        return cert, key

    def write(stem, cert, key):
        (tmp_path / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp_path / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca = issue("cachefs test CA", ca=True)
    write("ca", *ca)
    write("server", *issue("extender", ca, san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
    write("scheduler", *issue("kube-scheduler", ca))
    write("stranger", *issue("stranger", issue("another CA", ca=True)))
    return tmp_path


def test_off_loopback_the_extender_requires_kube_schedulers_client_certificate(tmp_path):
    pki = make_pki(tmp_path)
    port = free_port()
    proc = start_extender("--listen", f"127.0.0.1:{port}", "--tls-cert", str(pki / "server.crt"),
                          "--tls-key", str(pki / "server.key"), "--client-ca", str(pki / "ca.crt"))

    def client(stem=None):
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        if stem:
            ctx.load_cert_chain(str(pki / f"{stem}.crt"), str(pki / f"{stem}.key"))
        return ctx

    def prioritize(ctx):
        body = json.dumps({"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": [{"metadata": {"name": "a"}}]}})
        req = urllib.request.Request(f"https://127.0.0.1:{port}/prioritize", data=body.encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return json.loads(r.read())

    try:
        wait_until(lambda: prioritize(client("scheduler")) == [{"Host": "a", "Score": 0}], proc, "extender")
        for ctx in (client(), client("stranger")):
            with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
                prioritize(ctx)
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP gets no answer either
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        log = stop(proc)
    assert "Traceback" not in log, log

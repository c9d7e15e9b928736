"""The node tier's certificates: one CA, the API server's serving certificate (valid for every name a pod or the node
uses to reach it: the ``kubernetes`` Service's IP and names, the node's bridge address) and the API server's client
certificate for kubelet (``kubectl logs``, ``exec``). Keys are written 0600 in the tier's work directory, which is
removed with it."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write_key(path: Path, key) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


class Pki:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        self._valid = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=2))
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca = (x509.CertificateBuilder().subject_name(_name("cachefs-node-tier-ca"))
                    .issuer_name(_name("cachefs-node-tier-ca")).public_key(self._ca_key.public_key())
                    .serial_number(x509.random_serial_number())
                    .not_valid_before(self._valid[0]).not_valid_after(self._valid[1])
                    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                    .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                 content_commitment=False, key_encipherment=False,
                                                 data_encipherment=False, key_agreement=False,
                                                 encipher_only=False, decipher_only=False), critical=True)
                    .sign(self._ca_key, hashes.SHA256()))
        self.ca_file = directory / "ca.crt"
        self.ca_file.write_bytes(self._ca.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, cn: str, *, org: str | None = None, ips: tuple[str, ...] = (),
              dns: tuple[str, ...] = (), server: bool = False) -> tuple[Path, Path]:
        """A certificate signed by the CA: ``(cert file, key file)``."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(_name(cn, org)).issuer_name(self._ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(self._valid[0]).not_valid_after(self._valid[1])
                   .add_extension(x509.ExtendedKeyUsage(
                       [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False))
        sans = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips] + [x509.DNSName(d) for d in dns]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        cert_file, key_file = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_file, key)
        return cert_file, key_file

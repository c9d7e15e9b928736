"""TLS between the members of a cache group, from files a Kubernetes Secret provides (PEM).

Every member serves the group's certificate and presents the same one as a client; both sides accept only
certificates the group's CA signed. Host names are not checked: members are addressed by pod IP, which a group
certificate does not name. What a member may do is decided by its token, as without TLS (:mod:`.auth`); TLS adds
that bytes on the wire are private and that only holders of the Secret can talk to the peer port at all.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from cachefs.base.errors import ConfigError

__all__ = ["GroupTLS", "has_group_certificate"]


def has_group_certificate(transport) -> bool:
    """Whether the TLS connection under ``transport`` presented a client certificate (the handshake already
    refused one the group's CA did not sign)."""
    return bool(transport is not None and transport.get_extra_info("peercert"))


@dataclass(frozen=True)
class GroupTLS:
    cert: str
    key: str
    ca: str

    @classmethod
    def of(cls, cert: str, key: str, ca: str) -> GroupTLS | None:
        return cls(cert, key, ca) if cert and key and ca else None

    def _load(self, context: ssl.SSLContext) -> ssl.SSLContext:
        try:
            context.load_cert_chain(self.cert, self.key)
            context.load_verify_locations(self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cluster TLS ({self.cert}, {self.key}, {self.ca}): {exc}") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def server(self) -> ssl.SSLContext:
        """For the peer server: its certificate; a client certificate, when one is presented, must be of the
        group's CA. Whether one was is checked per request (:func:`has_group_certificate`): kubelet's probes of
        ``/healthz`` and ``/readyz`` come without one, every ``/v1/`` request must have one."""
        context = self._load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
        context.verify_mode = ssl.CERT_OPTIONAL
        return context

    def client(self) -> ssl.SSLContext:
        """For the peer client: the group's certificate presented, the server's checked against the CA."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        return self._load(context)

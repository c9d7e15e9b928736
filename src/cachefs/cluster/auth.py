"""Who may ask a node's peer server for bytes: members of its own cache group, proven by a token.

In Kubernetes every node pod mounts a projected ServiceAccount token with an audience of our own
(:data:`AUDIENCE`), rotated by kubelet. A peer server checks a presented token with a TokenReview (the API server
says whether it is valid, for our audience, and which pod and node it was issued to), remembers the answer for a
short while, and then checks that the node is a member of its group:

* no token, or one the API server rejects or that is not for our audience: 401;
* a valid token of another service account (any pod may ask kubelet for a token with our audience, but only node
  pods run as ``cachefs-system/cachefs-node``), or of a node outside this group: 403;
* the API server cannot be asked (down, overloaded): a token it accepted within the last :data:`STALE_TTL`
  seconds is still taken, any other is a 503 with Retry-After (:class:`ReviewUnavailable`), never a 500.

Without Kubernetes (``--peers``, one host, tests) the group shares a secret in a file (``--secret-file``,
``cluster.secret_file``): a token equal to it authenticates, and the member's name comes from the
``X-Cachefs-Member`` header. Either way is checked when the agent starts (:func:`check_credentials`): a secret file
that is missing or empty, or a secret and a token both named, stop it with one line instead of 401s between peers
later.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from dataclasses import dataclass

from cachefs.base.errors import ConfigError
from cachefs.kube import ApiError, KubeClient

__all__ = ["AUDIENCE", "NODE_ACCOUNT", "STALE_TTL", "Forbidden", "Identity", "ReviewUnavailable", "SharedSecret",
           "TokenReviewer", "Unauthorized", "check_credentials", "read_token"]

#: The audience of the tokens node pods present to each other.
AUDIENCE = "cachefs.io/peer"
#: The user a node pod's token stands for (deploy/base/rbac-node-agent.yaml).
NODE_ACCOUNT = "system:serviceaccount:cachefs-system:cachefs-node"


class Unauthorized(Exception):
    """No valid token (HTTP 401)."""


class Forbidden(Exception):
    """A valid token of someone not allowed here (HTTP 403)."""


class ReviewUnavailable(Exception):
    """The API server cannot check a token now (HTTP 503, Retry-After)."""


#: Seconds a token the API server accepted is still taken while the API server cannot be asked.
STALE_TTL = 900.0


@dataclass(frozen=True)
class Identity:
    """Who presented a token: the node its pod runs on (a member's name), and the pod."""

    node: str
    pod: str = ""
    #: The Kubernetes user the token stands for ("" for a shared secret).
    user: str = ""


def read_token(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def check_credentials(secret_file: str, token_file: str, *, token_named: bool) -> None:
    """ConfigError unless this member can prove itself to its group: a readable, non-empty ``secret_file``, or (no
    secret) a readable ``token_file``; never both named (``token_named``: the token file was set, not defaulted)."""
    if secret_file and token_named:
        raise ConfigError("cluster.secret_file (--secret-file) and cluster.token_file (--token-file) both given: a "
                          "group authenticates with one or the other")
    path, what = (secret_file, "cluster.secret_file (--secret-file)") if secret_file else \
        (token_file, "cluster.token_file (--token-file)")
    try:
        value = read_token(path)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path}: not text") from None
    if not value:
        raise ConfigError(f"{what} {path}: empty")


class SharedSecret:
    """A group secret read from a file (re-read every minute, so it can be rotated)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._read_at, self._secret = 0.0, ""

    def _current(self) -> str:
        if time.monotonic() - self._read_at > 60.0:
            self._secret, self._read_at = read_token(self.path), time.monotonic()
        return self._secret

    async def identify(self, token: str, claimed: str) -> Identity:
        secret = self._current()
        if not token or not secret or not hmac.compare_digest(token.encode(), secret.encode()):
            raise Unauthorized("no valid token")
        if not claimed:
            raise Unauthorized("no member name (X-Cachefs-Member)")
        return Identity(claimed)


class TokenReviewer:
    """Tokens checked by the API server (TokenReview), answers kept for ``ttl`` seconds per token."""

    def __init__(self, client: KubeClient, audience: str = AUDIENCE, *, account: str = NODE_ACCOUNT,
                 ttl: float = 120.0, max_entries: int = 10_000, stale_ttl: float = STALE_TTL) -> None:
        self.client, self.audience, self.ttl, self.max_entries = client, audience, ttl, max_entries
        self.stale_ttl = stale_ttl
        self.account = account
        self._cache: dict[bytes, tuple[float, Identity | None]] = {}
        self._inflight: dict[bytes, asyncio.Future] = {}
        self.reviews = 0

    async def identify(self, token: str, claimed: str = "") -> Identity:
        if not token:
            raise Unauthorized("no token")
        key = hashlib.blake2b(token.encode(), digest_size=16).digest()
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self.ttl:
            who = hit[1]
        else:
            fut = self._inflight.get(key)
            if fut is None:  # one review per token however many requests carry it at once
                fut = self._inflight[key] = asyncio.ensure_future(self._review(token))
                fut.add_done_callback(lambda f: self._inflight.pop(key, None))
            try:
                who = await asyncio.shield(fut)
            except ReviewUnavailable:
                if hit is None or hit[1] is None or now - hit[0] >= self.stale_ttl:
                    raise
                who = hit[1]  # accepted a little while ago: still taken while the API server is away
            else:
                if len(self._cache) >= self.max_entries:
                    self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.stale_ttl}
                self._cache[key] = (now, who)
        if who is None:
            raise Unauthorized("token rejected")
        if who.user != self.account:
            raise Forbidden(f"{who.user} is not a cachefs node pod")
        return who

    async def _review(self, token: str) -> Identity | None:
        self.reviews += 1
        try:
            doc = await self.client.post("/apis/authentication.k8s.io/v1/tokenreviews", {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]}})
        except ApiError as exc:
            if exc.retryable or exc.status in (401, 403):  # the API server's trouble, or our own rights: not the token's
                raise ReviewUnavailable(f"the API server cannot review tokens now: {exc}") from None
            raise Unauthorized(f"token review failed: {exc}") from None
        except (OSError, TimeoutError) as exc:
            raise ReviewUnavailable(f"the API server cannot be reached to review tokens: {exc}") from None
        status = doc.get("status") or {}
        if not status.get("authenticated") or self.audience not in (status.get("audiences") or []):
            return None
        user = status.get("user") or {}
        extra = user.get("extra") or {}
        node = (extra.get("authentication.kubernetes.io/node-name") or [""])[0]
        pod = (extra.get("authentication.kubernetes.io/pod-name") or [""])[0]
        if not node:
            return None  # not a token bound to a pod on a node: not a node pod's
        return Identity(node, pod, str(user.get("username") or ""))

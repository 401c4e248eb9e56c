"""Resume tokens of a cluster: each names the replica that made it and is signed with the
cluster's secret, so a front end routes a ``?resume=TOKEN`` without asking anyone and refuses a
forged or altered one before any replica sees it.

Format (opaque to clients, like every v1 token): ``REPLICA.RANDOM.MAC`` where RANDOM is 256
random bits and MAC is the first 128 bits of HMAC-SHA256(secret, ``REPLICA.RANDOM``), both
base64url. The replica a token names is where its session was opened; a drain or failover moves
the session, and the front end then finds it by asking the replicas (`web/cluster/frontend.py`).
"""

import base64
import hashlib
import hmac
import re
import secrets

__all__ = ["TokenSigner"]

REPLICA_NAME = re.compile(r"^[a-z0-9-]{1,64}$")
MAC_BYTES = 16


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenSigner:
    """Makes and checks a cluster's resume tokens (see the module docstring)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("a cluster secret needs at least 16 bytes")
        self._secret = secret

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest()[:MAC_BYTES])

    def issue(self, replica: str) -> str:
        """A new token naming ``replica``."""
        if not REPLICA_NAME.match(replica):
            raise ValueError(f"replica name {replica!r}: lowercase letters, digits and '-' only")
        body = f"{replica}.{secrets.token_urlsafe(32)}"
        return f"{body}.{self._mac(body)}"

    def replica_of(self, token: str) -> str | None:
        """The replica a genuine token names; None for a forged, altered or foreign one."""
        body, _, mac = token.rpartition(".")
        replica, _, _ = body.partition(".")
        if not REPLICA_NAME.match(replica) or not mac:
            return None
        if not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return None
        return replica

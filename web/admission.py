"""Who may open a websocket: the handshake checks of ``/v1/session``, run from ``process_request``.

* **Origin.** Browsers let any web page open a websocket to 127.0.0.1 and send that page's origin
  in ``Origin``; without a check, every page the user visits could start sessions here (cross-site
  websocket hijacking). Allowed: no ``Origin`` (clients that are not browsers), the same origin as
  the ``Host`` header (the browser client this server serves) and the configured origins (``*``:
  any). Anything else gets HTTP 403. A server listening on loopback also wants a loopback
  ``Host`` from a browser: DNS rebinding points an attacker's name at 127.0.0.1, and then that
  page's Origin and Host are the same name, so same-origin alone would let it in.
* **Connection cap.** Past ``max_connections`` websockets (handshaking or open), HTTP 503: each
  costs a socket, buffers and tasks even while idle.
"""

import http
import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit
from weakref import WeakSet

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response
from websockets.protocol import State

__all__ = ["Admission", "is_loopback", "same_origin"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address, without port) can only mean this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name (it may resolve anywhere) or "" (every interface)
        return False


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) names the host:port the request was sent to."""
    parts = urlsplit(origin)
    return (
        host is not None
        and parts.scheme in ("http", "https")
        and parts.netloc.lower() == host.strip().lower()
        and not (parts.path or parts.query or parts.fragment)
    )


class Admission:
    """The handshake gate of one server (see the module docstring)."""

    def __init__(
        self, max_connections: int, allow_origins: Iterable[str] = (), loopback_hosts_only: bool = False
    ) -> None:
        self.max_connections = max_connections
        self.allow_origins = frozenset(o.rstrip("/").lower() for o in allow_origins)
        self.loopback_hosts_only = loopback_hosts_only  # the server listens on loopback only
        self._admitted: WeakSet[ServerConnection] = WeakSet()  # let through, until closed

    def origin_allowed(self, request: Request) -> bool:
        """No Origin, the same origin, or one configured."""
        origins = request.headers.get_all("Origin")
        if not origins:
            return True
        if len(origins) > 1:
            return False
        origin = origins[0].strip()
        if "*" in self.allow_origins or origin.rstrip("/").lower() in self.allow_origins:
            return True
        hosts = request.headers.get_all("Host")
        if len(hosts) != 1 or not same_origin(origin, hosts[0]):
            return False
        return not self.loopback_hosts_only or is_loopback(urlsplit(origin).hostname or "")

    def __call__(self, connection: ServerConnection, request: Request) -> Response | None:
        """403 or 503 for a refused handshake; None lets it proceed."""
        if not self.origin_allowed(request):
            return connection.respond(http.HTTPStatus.FORBIDDEN, "origin not allowed\n")
        live = sum(1 for c in self._admitted if c.state is not State.CLOSED)
        if live >= self.max_connections:
            busy = http.HTTPStatus.SERVICE_UNAVAILABLE
            return connection.respond(busy, "too many connections; retry later\n")
        self._admitted.add(connection)
        return None

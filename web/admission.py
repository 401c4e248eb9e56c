"""Who may talk to the server: the ``Host`` check of every HTTP request and the handshake checks
of ``/v1/session``, run from ``process_request``.

* **Host.** A server listening on loopback answers only requests addressed to a loopback name
  (``localhost``, ``127.x.x.x``, ``[::1]``) or to the host of a configured origin: DNS rebinding
  points an attacker's name at 127.0.0.1, and that page's requests then carry the attacker's
  name as ``Host``. Anything else gets HTTP 403, the plain routes (``/metrics``, ``/v1/models``,
  ...) as well as the websocket handshake.
* **Origin.** Browsers let any web page open a websocket to 127.0.0.1 and send that page's origin
  in ``Origin``; without a check, every page the user visits could start sessions here (cross-site
  websocket hijacking). Allowed: no ``Origin`` (clients that are not browsers), the same origin as
  the ``Host`` header, scheme included (the browser client this server serves: ``http``, since
  the server does not terminate TLS) and the configured origins (``*``: any). Anything else gets
  HTTP 403. A server listening on loopback also wants that origin's host to be a loopback name.
* **Connection caps.** Past ``max_connections`` websockets (handshaking or open), or past
  ``per_address`` of them from one client address, HTTP 503: each costs a socket, buffers and
  tasks even while idle, and one client must not take every slot. An IPv6 client is counted by
  its /64, which one host usually holds whole. Loopback clients count like any other (a local
  user is not necessarily a trusted one).
"""

import http
import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit
from weakref import WeakKeyDictionary

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response
from websockets.protocol import State

__all__ = ["Admission", "address_key", "host_name", "is_loopback", "same_origin"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address, without port) can only mean this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name (it may resolve anywhere) or "" (every interface)
        return False


def host_name(host: str) -> str:
    """The name or address in a ``Host`` value (``name[:port]`` or ``[v6][:port]``); "" when
    the value is not of that form."""
    host = host.strip()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
    else:
        name, _, port = host.partition(":")
        rest = f":{port}" if port else ""
    if rest and not (rest[0] == ":" and rest[1:].isdigit()):
        return ""
    return name


def same_origin(origin: str, host: str | None, scheme: str = "http") -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) is the page a server reached at ``host``
    serves over ``scheme``."""
    parts = urlsplit(origin)
    return (
        host is not None
        and parts.scheme == scheme
        and parts.netloc.lower() == host.strip().lower()
        and not (parts.path or parts.query or parts.fragment)
    )


def address_key(address: str) -> str:
    """What one client is counted by: its IPv4 address, or its IPv6 address's /64."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # not an IP socket: count the peer name as it is
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Admission:
    """The request gate of one server (see the module docstring)."""

    def __init__(
        self,
        max_connections: int,
        allow_origins: Iterable[str] = (),
        *,
        per_address: int = 0,
        loopback_hosts_only: bool = False,
        scheme: str = "http",
    ) -> None:
        """``per_address`` 0: no cap per client address; ``scheme``: what browsers reach the
        server over (``http``: it does not terminate TLS)."""
        self.max_connections = max_connections
        self.per_address = per_address
        self.allow_origins = frozenset(o.rstrip("/").lower() for o in allow_origins)
        self.origin_hosts = frozenset(urlsplit(o).netloc for o in self.allow_origins)  # Hosts they use
        self.loopback_hosts_only = loopback_hosts_only  # the server listens on loopback only
        self.scheme = scheme
        self._admitted: WeakKeyDictionary[ServerConnection, str] = WeakKeyDictionary()  # -> address key

    def host_allowed(self, request: Request) -> bool:
        """Any Host on a server listening beyond loopback; on loopback, one loopback name or the
        host of a configured origin (every Host when any origin is allowed)."""
        if not self.loopback_hosts_only or "*" in self.allow_origins:
            return True
        hosts = request.headers.get_all("Host")
        if len(hosts) != 1:
            return False
        host = hosts[0].strip().lower()
        return is_loopback(host_name(host)) or host in self.origin_hosts

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
        if len(hosts) != 1 or not same_origin(origin, hosts[0], self.scheme):
            return False
        return not self.loopback_hosts_only or is_loopback(urlsplit(origin).hostname or "")

    def __call__(self, connection: ServerConnection, request: Request) -> Response | None:
        """403 or 503 for a refused handshake; None lets it proceed. The Host check comes
        before, for every path (`host_allowed`, web.routes)."""
        if not self.origin_allowed(request):
            return connection.respond(http.HTTPStatus.FORBIDDEN, "origin not allowed\n")
        busy = http.HTTPStatus.SERVICE_UNAVAILABLE
        live = [key for c, key in list(self._admitted.items()) if c.state is not State.CLOSED]
        if len(live) >= self.max_connections:
            return connection.respond(busy, "too many connections; retry later\n")
        peer = connection.remote_address
        key = address_key(str(peer[0]) if peer else "")
        if self.per_address > 0 and live.count(key) >= self.per_address:
            return connection.respond(busy, "too many connections from this address; retry later\n")
        self._admitted[connection] = key
        return None

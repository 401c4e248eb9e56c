"""web/admission: which browser handshakes may open a websocket."""

from __future__ import annotations

import pytest
from websockets.datastructures import Headers
from websockets.http11 import Request

from web.admission import Admission, is_loopback


def request(origin: str | None, host: str) -> Request:
    headers = Headers({"Host": host})
    if origin is not None:
        headers["Origin"] = origin
    return Request("/v1/session", headers)


def test_dns_rebinding_is_refused_on_a_loopback_server() -> None:
    """An attacker's name resolving to 127.0.0.1 makes the page's Origin and Host agree."""
    gate = Admission(8, loopback_hosts_only=True)
    assert not gate.origin_allowed(request("http://evil.example:8000", "evil.example:8000"))
    for here in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000"):
        assert gate.origin_allowed(request(f"http://{here}", here)), here
    assert gate.origin_allowed(request(None, "evil.example:8000"))  # not a browser
    # a server listening beyond loopback is reached by other names: same-origin is the rule there
    assert Admission(8).origin_allowed(request("http://box.lan:8000", "box.lan:8000"))
    assert Admission(8, ["http://evil.example:8000"], loopback_hosts_only=True).origin_allowed(
        request("http://evil.example:8000", "evil.example:8000")
    )  # explicitly allowed


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("", False),
        ("example.com", False),
        ("192.168.1.5", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback

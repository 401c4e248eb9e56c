"""web/admission: which browser handshakes may open a websocket."""

from __future__ import annotations

import pytest
from websockets.datastructures import Headers
from websockets.http11 import Request

from web.admission import Admission, address_key, host_name, is_loopback, same_origin


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


def test_same_origin_compares_the_scheme() -> None:
    assert same_origin("http://127.0.0.1:8000", "127.0.0.1:8000")
    assert not same_origin("https://127.0.0.1:8000", "127.0.0.1:8000")  # this server speaks http
    assert same_origin("https://app.example", "app.example", scheme="https")
    assert not same_origin("http://127.0.0.1:8000/x", "127.0.0.1:8000")


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("127.0.0.1:8000", "127.0.0.1"),
        ("localhost", "localhost"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("evil.example@127.0.0.1", "evil.example@127.0.0.1"),  # not a loopback name either
        ("127.0.0.1:80:80", ""),
        ("127.0.0.1:x", ""),
        ("[::1]x", ""),
    ],
)
def test_host_name(value: str, name: str) -> None:
    assert host_name(value) == name


def test_hosts_a_loopback_server_answers() -> None:
    gate = Admission(8, ["https://app.example"], loopback_hosts_only=True)
    for host in ("127.0.0.1:8000", "LOCALHOST:8000", "[::1]:8000", "127.1.2.3", "app.example"):
        assert gate.host_allowed(request(None, host)), host
    for host in ("evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io", "app.example:8000"):
        assert not gate.host_allowed(request(None, host)), host
    assert not gate.host_allowed(Request("/", Headers()))  # no Host at all
    assert Admission(8).host_allowed(request(None, "box.lan:8000"))  # listening beyond loopback
    assert Admission(8, ["*"], loopback_hosts_only=True).host_allowed(request(None, "evil.example"))


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),  # one host holds a whole /64
        ("2001:db8:1:2:ffff::9", "2001:db8:1:2::/64"),
        ("::1", "::/64"),
    ],
)
def test_address_key(address: str, key: str) -> None:
    assert address_key(address) == key

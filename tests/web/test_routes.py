"""web/routes.py: the plain HTTP routes on the websocket port."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from web import messages as m

from .conftest import dial, recv, run, send, serving


def get(url: str) -> tuple[int, str, bytes]:
    """(status, content type, body); proxies bypassed, errors returned rather than raised."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=30) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


async def fetch(url: str) -> tuple[int, str, bytes]:
    return await asyncio.to_thread(get, url)


def test_http_routes(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep"))
            await recv(ws)
            await send(ws, m.Step(seq=1, actions=[{}]))
            await recv(ws)

            status, ctype, body = await fetch(server.url + "/healthz")
            health = json.loads(body)
            assert status == 200 and ctype == "application/json"
            assert health == {"status": "ok", "protocol": 1, "sessions": 1, "models": sorted(worlds)}

            status, ctype, body = await fetch(server.url + "/metrics")
            text = body.decode()
            assert status == 200 and ctype.startswith("text/plain")
            for name in (
                "worldserve_ws_connections_open",
                "worldserve_sessions 1.0",
                "worldserve_encode_ms_bucket",
                "worldserve_dropped_frames_total",
                "worldserve_errors_total",
                'worldserve_messages_in_total{type="step"}',
                "worldserve_chunk_stage_ms_bucket",  # the runtime's, same registry
            ):
                assert name in text, name

            status, _, body = await fetch(server.url + "/v1/models")
            models = {x["id"]: x for x in json.loads(body)}
            assert status == 200 and sorted(models) == sorted(worlds)
            tiny = models["tiny"]
            assert tiny["default"] and not models["smooth"]["default"]
            assert (tiny["width"], tiny["height"], tiny["chunk_frames"], tiny["fps"]) == (32, 32, 4, 15.0)
            assert tiny["action_space"] == {
                "keys": ["w", "a", "s", "d", "space"],
                "mouse": True,
                "vector_dim": 2,
            }
            assert models["tiny-image"]["image_start"] and not tiny["prompts"]

            status, _, body = await fetch(server.url + "/v1/protocol.json")
            schema = json.loads(body)
            assert (
                status == 200
                and schema["protocol"] == 1
                and schema == json.loads(json.dumps(m.json_schema()))
            )

            status, ctype, body = await fetch(server.url + "/")
            assert status == 200 and ctype == "text/html; charset=utf-8" and b"worldserve" in body
            assert (await fetch(server.url + "/index.html"))[2] == body

            for missing in ("/nope", "/../pyproject.toml", "/%2e%2e/pyproject.toml", "/v1"):
                assert (await fetch(server.url + missing))[0] == 404, missing
            assert (await fetch(server.url + "/v1/session"))[0] == 426  # a websocket endpoint

    run(main())


async def raw_get(port: int, target: bytes, host: bytes = b"127.0.0.1", headers: bytes = b"") -> int:
    """The status of a GET sent byte for byte (no client library would send a NUL, or lie in Host)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\n" + headers + b"\r\n")
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    writer.close()
    return status


def test_odd_static_paths_are_client_errors(worlds, caplog) -> None:
    async def main():
        async with serving(worlds) as server:
            assert await raw_get(server.port, b"/a\x00b") == 400
            assert await raw_get(server.port, b"/" + b"a" * 256) == 404  # longer than a file name
            assert await raw_get(server.port, b"/" + b"a/" * 3000) == 404  # longer than a path
            assert await raw_get(server.port, b"/") == 200

    run(main())
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


UPGRADE = (
    b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)


def test_a_loopback_server_answers_only_loopback_hosts(worlds) -> None:
    """DNS rebinding: a page whose name resolves to 127.0.0.1 reaches us with its own name as Host."""

    async def main():
        async with serving(worlds) as server:
            port = server.port
            paths = (b"/", b"/healthz", b"/metrics", b"/v1/models", b"/v1/protocol.json", b"/nope")
            for path in paths:
                for evil in (b"evil.example", b"evil.example:%d" % port, b"127.0.0.1.evil.example"):
                    assert await raw_get(port, path, evil) == 403, (path, evil)
            for here in (b"127.0.0.1:%d" % port, b"localhost:%d" % port, b"[::1]:%d" % port, b"localhost"):
                assert await raw_get(port, b"/healthz", here) == 200, here
            assert await raw_get(port, b"/v1/session", b"evil.example", UPGRADE) == 403  # no Origin either
            assert await raw_get(port, b"/v1/session", b"localhost:%d" % port, UPGRADE) == 101
        async with serving(worlds, allow_origins=("https://app.example",)) as server:
            # a proxy in front, serving an allowed origin, may pass its Host on
            assert await raw_get(server.port, b"/healthz", b"app.example") == 200
            assert await raw_get(server.port, b"/healthz", b"evil.example") == 403
        async with serving(worlds, allow_origins=("*",)) as server:
            assert await raw_get(server.port, b"/healthz", b"evil.example") == 200  # every page allowed

    run(main())

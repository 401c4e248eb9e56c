"""Helpers for the browser tests: a client page with waits on ``window.__worldserve``, canvas
reads and screenshots, and a TCP relay that can cut its connections."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.sync_api import Page

ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts" / "browser"


class ClientPage:
    """A page of the client plus helpers (wait for __worldserve conditions, read the canvas)."""

    def __init__(self, page: Page, name: str) -> None:
        self.page = page
        self.name = name
        self.console: list[str] = []  # console errors and uncaught exceptions
        page.on("console", lambda m: m.type == "error" and self.console.append(m.text))
        page.on("pageerror", lambda e: self.console.append(f"uncaught: {e}"))

    def state(self) -> dict[str, Any]:
        """window.__worldserve, as JSON."""
        return self.page.evaluate("() => JSON.parse(JSON.stringify(window.__worldserve))")

    def wait(self, condition: str, timeout_s: float = 20.0) -> dict[str, Any]:
        """Wait until the JS expression (with `s` = window.__worldserve) holds; returns the state."""
        try:
            self.page.wait_for_function(
                f"() => {{ const s = window.__worldserve; return Boolean(s && ({condition})); }}",
                timeout=timeout_s * 1000,
                polling=50,
            )
        except Exception as exc:
            state = self.page.evaluate("() => JSON.stringify(window.__worldserve)")
            raise AssertionError(
                f"timed out waiting for {condition}; state: {state}; page errors: {self.console}"
            ) from exc
        return self.state()

    def pixels(self) -> bytes:
        """The canvas's RGBA pixels."""
        values = self.page.evaluate(
            """() => { const c = document.getElementById('screen');
                       return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); }"""
        )
        return bytes(values)

    def run_for(self, seconds: float) -> None:
        """Let the page play for a while (playback is paced in real time)."""
        self.page.wait_for_timeout(seconds * 1000)

    def hud(self, key: str) -> str:
        """The text of one HUD cell."""
        return self.page.inner_text(f'#hud [data-k="{key}"]')

    def screenshot(self, label: str = "") -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{self.name}{'-' + label if label else ''}.png"
        self.page.screenshot(path=str(path))
        return path


def blank(rgba: bytes) -> bool:
    """True when the picture is one flat colour (nothing drawn, or a black frame)."""
    rgb = [rgba[i : i + 3] for i in range(0, len(rgba), 4)]
    return len(set(rgb)) <= 1


class DropProxy:
    """A TCP relay on loopback whose ``drop()`` cuts every connection, as a network failure does."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closing = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def drop(self) -> int:
        """Cut every open connection (no close frames); returns how many sockets were cut."""
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
                s.shutdown(socket.SHUT_RDWR)  # wakes the relay threads blocked in recv()
            s.close()
        return len(socks)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        self.drop()
        self._thread.join(5)

"""The browser client (web/static/) driven in a real headless Chromium through Playwright.

Debian's ``chromium`` and the Python ``playwright`` package (which drives it; it never downloads a
browser here) are installed by ``.ci/run``. Without them these tests skip with the reason, except
under CI (``CI=true``), where a missing browser is a failure: the tests must run there.
``WORLDSERVE_CHROMIUM`` overrides the browser path. Screenshots go to ``test-artifacts/browser/``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from models.world import World
from tests.web.browser.harness import ClientPage, DropProxy
from tests.web.conftest import serving_in_thread
from web.server import Server

if TYPE_CHECKING:
    from playwright.sync_api import Browser
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--autoplay-policy=no-user-gesture-required",
]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives web/static/ in headless Chromium (Playwright)")


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; .ci/run installs it, and the browser tests must run in CI")
    pytest.skip(reason)


def chromium_path() -> str | None:
    """The Chromium to drive: $WORLDSERVE_CHROMIUM, or Debian's; None when it is not there."""
    path = os.environ.get("WORLDSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    return path if os.access(path, os.X_OK) else None


@pytest.fixture(scope="package")  # Playwright's sync API holds an event loop: end it with the package
def browser() -> Iterator[Browser]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the Python package playwright is not installed (pip install playwright)")
    path = chromium_path()
    if path is None:
        _missing("Chromium is not installed (apt-get install chromium, or set WORLDSERVE_CHROMIUM)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="package")
def server(worlds: dict[str, World]) -> Iterator[Server]:
    """A server on loopback over the small test worlds; "smooth" (32x32) is the default model."""
    with serving_in_thread(worlds, default_model="smooth") as server:
        yield server


@pytest.fixture
def open_page(
    browser: Browser, server: Server, request: pytest.FixtureRequest
) -> Iterator[Callable[..., ClientPage]]:
    """``open_page(query, base=None)``: a fresh browser context on ``base + "/" + query``."""
    contexts = []

    def open_(query: str = "", base: str | None = None) -> ClientPage:
        context = browser.new_context(viewport={"width": 1100, "height": 760})
        contexts.append(context)
        page = ClientPage(context.new_page(), request.node.name)
        page.page.goto(f"{base or server.url}/{query}")
        return page

    yield open_
    for context in contexts:
        context.close()


@pytest.fixture
def proxy(server: Server) -> Iterator[DropProxy]:
    relay = DropProxy(server.port)
    try:
        yield relay
    finally:
        relay.close()

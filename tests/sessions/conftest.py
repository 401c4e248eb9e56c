"""A real engine thread + session manager over the small test worlds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from runtime.engine import Engine, EngineThread
from runtime.runner import BoundaryHook
from sessions.events import SessionEvent
from sessions.manager import SessionManager
from tests.runtime.conftest import small_world


@pytest.fixture(scope="session")
def worlds():
    return {"tiny": small_world(), "tiny-image": small_world(image_start=True, name="tiny-image")}


@contextlib.asynccontextmanager
async def running(
    worlds,
    thread: type[EngineThread] = EngineThread,
    hook: BoundaryHook | None = None,
    retention: int = 0,
    **kw,
) -> AsyncIterator[SessionManager]:
    """A started engine thread (of class `thread`, its engine with boundary `hook` and rewind
    `retention`) and a manager."""
    engine = Engine(worlds, max_batch=4, boundary_hook=hook, retention=retention)
    et = thread(engine, asyncio.get_running_loop())
    et.start()
    manager = SessionManager(et, default_model="tiny", **kw)
    try:
        yield manager
    finally:
        await manager.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, et.close)


class Inbox:
    """A sink that records events and lets a test wait for some."""

    def __init__(self) -> None:
        self.events: list[SessionEvent] = []
        self._changed = asyncio.Event()

    def __call__(self, ev: SessionEvent) -> None:
        self.events.append(ev)
        self._changed.set()

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    async def wait_for(self, kind: type, n: int = 1, timeout: float = 60.0) -> list:
        async def loop():
            while len(self.of(kind)) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(loop(), timeout)
        return self.of(kind)

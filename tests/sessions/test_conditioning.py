"""Sessions whose world's conditioning runs off the engine thread (runtime/conditioning.py)."""

from __future__ import annotations

import asyncio

import pytest

from runtime.engine import Engine, EngineThread
from sessions.errors import SessionBusy
from sessions.events import FramesEvent
from sessions.manager import OpenParams, SessionManager
from tests.runtime.conftest import small_world
from tests.runtime.test_conditioning import GATED, HANG_GUARD_S, Gate
from tests.sessions.conftest import Inbox


def test_a_reset_refused_by_a_full_conditioning_worker_is_busy_and_keeps_the_world():
    world = small_world(image_start=True, name="img")
    gate = Gate(world)

    async def main():
        engine = Engine({"img": world}, max_preparing=1)
        et = EngineThread(engine, asyncio.get_running_loop())
        et.start()
        m = SessionManager(et, default_model="img")
        try:
            s = await m.open(OpenParams(seed=1, mode="lockstep"))
            other = asyncio.create_task(m.open(OpenParams(seed=GATED, mode="lockstep")))
            assert await asyncio.to_thread(gate.started.wait, HANG_GUARD_S)  # the worker is full
            with pytest.raises(SessionBusy):
                await m.reset(s, seq=1, seed=2)
            inbox = Inbox()
            s.activate(inbox)
            s.step(2, [])  # the old world goes on
            (frames,) = await inbox.wait_for(FramesEvent, 1)
            assert frames.chunk == 1
            gate.release.set()
            assert (await asyncio.wait_for(other, HANG_GUARD_S)).frame is not None
        finally:
            gate.release.set()
            await m.shutdown()
            await asyncio.get_running_loop().run_in_executor(None, et.close)

    asyncio.run(main())

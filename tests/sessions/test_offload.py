"""Offload under a device budget: detached sessions leave the device for host memory (and past
`host_memory` for disk) when a new or returning session needs the room, and come back on resume
continuing bit for bit; `busy` only when nothing can move."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from runtime.engine import Engine, EngineThread
from sessions.errors import SessionBusy
from sessions.events import FramesEvent
from sessions.manager import OpenParams, SessionManager
from sessions.store import StateStore
from tests.sessions.conftest import Inbox, running
from tests.sessions.test_saved import STEPS, _steps


@contextlib.asynccontextmanager
async def budgeted(worlds, device_sessions: int, **kw):
    engine = Engine({"tiny": worlds["tiny"]}, max_batch=4, max_streams=device_sessions)
    et = EngineThread(engine, asyncio.get_running_loop())
    et.start()
    manager = SessionManager(et, default_model="tiny", max_sessions=16, **kw)
    try:
        yield manager
    finally:
        await manager.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, et.close)


async def _reference(worlds, seeds) -> dict[int, list[np.ndarray]]:
    out = {}
    async with running(worlds) as m:
        for seed in seeds:
            s = await m.open(OpenParams(seed=seed, mode="lockstep"))
            inbox = Inbox()
            s.activate(inbox)
            out[seed] = [e.frames for e in await _steps(s, inbox, STEPS)]
            await m.close(s)
    return out


@pytest.mark.parametrize("host_memory", [1 << 30, 1], ids=["host", "disk"])
def test_sessions_over_the_device_budget_move_off_it_and_come_back_exactly(worlds, tmp_path, host_memory):
    async def main():
        seeds = list(range(20, 26))
        want = await _reference(worlds, seeds)
        async with budgeted(worlds, 2, host_memory=host_memory, spill=StateStore(tmp_path)) as m:
            sessions = {}
            for seed in seeds:
                s = await m.open(OpenParams(seed=seed, mode="lockstep"))
                inbox = Inbox()
                s.activate(inbox)
                await _steps(s, inbox, STEPS[:2])
                s.ack(2)
                s.detach()
                sessions[seed] = s
            where = m.residence()
            off = "host" if host_memory > 1 else "disk"
            assert where["device"][0] == 2 and where[off][0] == 4 and where[off][1] > 0
            assert len(m) == 6 and (off == "host") != bool(list(tmp_path.glob("*.safetensors")))
            for seed, s in sessions.items():  # every one comes back, pushing others off
                await m.ensure_resident(s)
                assert m.offloaded(s) is None
                inbox = Inbox()
                assert s.activate(inbox) == []
                got = [e.frames for e in await _steps(s, inbox, STEPS[2:], first_seq=2)]
                assert [e.chunk for e in inbox.of(FramesEvent)] == [3, 4]
                for x, y in zip(want[seed][2:], got, strict=True):
                    assert np.array_equal(x, y)
                s.detach()
            assert sum(n for n, _ in m.residence().values()) == 6

    asyncio.run(main())


def test_busy_only_when_nothing_can_leave_the_device(worlds):
    async def main():
        async with budgeted(worlds, 2, host_memory=1 << 30) as m:
            a, b = await m.open(OpenParams()), await m.open(OpenParams())
            a.activate(Inbox())
            b.activate(Inbox())
            with pytest.raises(SessionBusy):
                await m.open(OpenParams())
            b.detach()
            c = await m.open(OpenParams())  # b moves to host memory instead of closing
            assert m.offloaded(b) == "host" and not b.status.is_finished
            c.activate(Inbox())
            with pytest.raises(SessionBusy):  # b cannot come back: a and c are attached
                await m.ensure_resident(b)
            assert m.offloaded(b) == "host"

    asyncio.run(main())

"""Transactional promises seen from outside: a cancel is never lost, and an out-of-range action
cannot ruin a world (issue: exact under races)."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.web.conftest import dial, recv, recv_until, run, send
from web import messages as m


def test_a_cancel_right_after_a_step_wins_while_another_session_runs(v1) -> None:
    async def main() -> None:
        async with v1(debug_hooks=True) as server:
            busy = await dial(server)
            # a slow realtime session keeps the engine busy, so the step waits in its input queue
            await send(busy, m.Open(mode="realtime", codec="raw", debug=m.DebugHooks(step_delay_ms=150)))
            await recv_until(busy, m.Ready)
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw"))
            await recv_until(ws, m.Ready)
            for seq in range(0, 8, 2):
                await send(ws, m.Step(seq=seq, actions=(m.FrameAction(keys=("d",)),)))
                await send(ws, m.Cancel(seq=seq + 1))
                got = await recv(ws)
                assert isinstance(got, m.Cancelled) and got.seq == seq + 1 and got.chunk == 1, got
            # nothing was committed: the next step is chunk 1
            await send(ws, m.Step(seq=100, actions=(m.FrameAction(),)))
            frames = await recv(ws)
            assert isinstance(frames, m.Frames) and frames.chunk == 1
            await busy.close()
            await ws.close()

    run(main())


def test_huge_mouse_is_refused_and_the_world_stays_playable(v1) -> None:
    async def main() -> None:
        async with v1() as server:
            ref = await dial(server)
            ws = await dial(server)
            for c in (ref, ws):
                await send(c, m.Open(mode="lockstep", codec="raw", seed=4))
                await recv_until(c, m.Ready)
            await send(ws, m.Step(seq=1, actions=(m.FrameAction(mouse=(1e39, 0.0)),)))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and not err.fatal
            assert err.message.startswith("mouse")
            await send(ws, m.Action(seq=2, keys=(), mouse=(1e300, 0.0)))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and not err.fatal
            for c in (ref, ws):
                await send(c, m.Step(seq=3, actions=(m.FrameAction(mouse=(3.0, 1.0)),)))
            a, b = await asyncio.gather(recv(ref), recv(ws))
            assert isinstance(a, m.Frames) and isinstance(b, m.Frames) and a.chunk == b.chunk == 1
            assert np.array_equal(a.data, b.data) and a.data.any()
            await ref.close()
            await ws.close()

    run(main())

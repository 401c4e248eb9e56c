"""Queued lockstep steps are answered across `reset`, `fork` and `close`, seen from a raw
client (issue 39, item 3): each step gets its `frames`, or a `cancelled` covers it, or `closed`
ends the session. Slow chunks (the `step_delay_ms` hook) keep the steps queued; the checks hold
whatever number of them committed first."""

from __future__ import annotations

from tests.web.conftest import dial, recv, recv_until, run, send
from web import messages as m

STEPS = 8  # the most a session may have outstanding
SLOW = m.DebugHooks(step_delay_ms=100)


async def open_lockstep(server):
    ws = await dial(server)
    await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, debug=SLOW))
    await recv_until(ws, m.Ready)
    for seq in range(STEPS):
        await send(ws, m.Step(seq=seq, actions=(m.FrameAction(keys=("d",)),)))
    return ws


def test_reset_with_eight_steps_queued_answers_each_before_ready(v1) -> None:
    async def main() -> None:
        async with v1(debug_hooks=True) as server:
            ws = await open_lockstep(server)
            await send(ws, m.Reset(seq=50, seed=4))
            got = await recv_until(ws, m.Ready)
            ready = got.pop()
            frames = [x for x in got if isinstance(x, m.Frames)]
            k = len(frames)
            assert [f.chunk for f in frames] == list(range(1, k + 1))
            assert [f.action_seq for f in frames] == list(range(k))
            rest = got[k:]  # the steps that did not commit: one `cancelled`, as a cancel's
            assert k < STEPS and len(rest) == 1, got
            assert isinstance(rest[0], m.Cancelled) and (rest[0].seq, rest[0].chunk) == (50, k + 1)
            assert ready.chunk == k
            await send(ws, m.Step(seq=60, actions=(m.FrameAction(),)))
            nxt = await recv(ws)
            assert isinstance(nxt, m.Frames) and nxt.chunk == k + 1 and nxt.action_seq == 60
            await ws.close()

    run(main())


def test_fork_with_eight_steps_queued_keeps_every_step(v1) -> None:
    async def main() -> None:
        async with v1(debug_hooks=True) as server:
            ws = await open_lockstep(server)
            await send(ws, m.Fork(seq=50))
            got = await recv_until(ws, m.Forked)
            while sum(isinstance(x, m.Frames) for x in got) < STEPS:
                got.append(await recv(ws))
            assert not any(isinstance(x, m.Cancelled | m.Error) for x in got), got
            frames = [x for x in got if isinstance(x, m.Frames)]
            assert [f.chunk for f in frames] == list(range(1, STEPS + 1))
            forked = next(x for x in got if isinstance(x, m.Forked))
            copy = await dial(server, f"?resume={forked.resume_token}")
            (ready,) = await recv_until(copy, m.Ready)
            assert 0 <= ready.chunk <= STEPS  # the committed world when the fork was made
            await copy.close()
            await ws.close()

    run(main())


def test_close_answers_a_waiting_cancel_before_closed(v1) -> None:
    async def main() -> None:
        async with v1(debug_hooks=True) as server:
            ws = await open_lockstep(server)
            await send(ws, m.Cancel(seq=50))
            await send(ws, m.Close())
            got = await recv_until(ws, m.Closed)
            assert got[-1].reason == "closed"
            cancels = [x for x in got if isinstance(x, m.Cancelled)]
            frames = [x for x in got if isinstance(x, m.Frames)]
            assert len(cancels) == 1 and cancels[0].seq == 50
            assert cancels[0].chunk == len(frames) + 1 and got[-2] is cancels[0]

    run(main())

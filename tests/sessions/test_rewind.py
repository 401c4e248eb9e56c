"""`Session.rewind` over a real engine thread: back to a retained chunk, the same actions give
the original frames and numbers; outstanding steps are answered as a reset answers them; beyond
the retention `NotRetained` and the session goes on; realtime sessions rewind too."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from models.actions import FrameAction
from runtime.requests import DebugHooks
from sessions.errors import InvalidInput, NotRetained
from sessions.events import CancelledEvent, FramesEvent, ReadyEvent
from sessions.manager import OpenParams
from tests.sessions.conftest import Inbox, running

SCRIPT = [[FrameAction(frozenset({k}))] for k in "wdaswdas"]


def run(coro):
    return asyncio.run(coro)


async def stepped(s, inbox: Inbox, script, seq0: int = 0) -> list[FramesEvent]:
    before = len(inbox.of(FramesEvent))
    for i, a in enumerate(script):
        s.step(seq0 + i, a)
    return (await inbox.wait_for(FramesEvent, before + len(script)))[before:]


def same(a: list[FramesEvent], b: list[FramesEvent]) -> bool:
    return [(e.chunk, e.frame0) for e in a] == [(e.chunk, e.frame0) for e in b] and all(
        np.array_equal(x.frames, y.frames) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("model", ["tiny", "tiny-image"])
def test_rewind_then_the_same_steps_give_the_same_frames_and_numbers(worlds, model):
    async def main():
        async with running(worlds, retention=3) as m:
            s = await m.open(OpenParams(model=model, seed=4, mode="lockstep"))
            inbox = Inbox()
            s.activate(inbox)
            original = await stepped(s, inbox, SCRIPT[:6])
            await s.rewind(10, 4)
            (ready,) = await inbox.wait_for(ReadyEvent)
            assert ready.chunk == 4 and np.array_equal(ready.frame, original[3].frames[-1])
            assert (s.last_chunk, s.frames_out) == (4, original[4].frame0)
            first, logged = await s.action_log()
            assert first == 1 and len(logged) == 4  # chunks 1-4: the rewound ones are gone
            s.ack(6)  # shown before the client heard of the rewind: ignored, not an error
            assert s.acked == 4
            assert same(await stepped(s, inbox, SCRIPT[4:6], 11), original[4:])
            assert not inbox.of(CancelledEvent)

    run(main())


def test_rewind_beyond_the_retention_is_not_retained_and_the_session_goes_on(worlds):
    async def main():
        async with running(worlds, retention=2) as m:
            s = await m.open(OpenParams(model="tiny", seed=4, mode="lockstep"))
            inbox = Inbox()
            s.activate(inbox)
            await stepped(s, inbox, SCRIPT[:5])
            with pytest.raises(NotRetained, match="earliest chunk this session can go back to is 3"):
                await s.rewind(9, 2)
            with pytest.raises(InvalidInput):
                await s.rewind(9, 6)  # not sent yet
            assert not inbox.of(ReadyEvent)
            (nxt,) = await stepped(s, inbox, SCRIPT[5:6], 10)
            assert nxt.chunk == 6
            await m.reset(s, 11, seed=5)
            await inbox.wait_for(ReadyEvent)
            with pytest.raises(NotRetained, match="before the last reset"):
                await s.rewind(12, 5)

    run(main())


def test_steps_outstanding_at_a_rewind_are_answered_as_a_reset_answers_them(worlds):
    """Slow steps queued behind each other, then a rewind: the ones that committed come as
    frames, then one `cancelled` (the rewind's seq), then `ready`; the world is exact after."""

    async def main():
        async with running(worlds, retention=4, allow_debug_hooks=True) as m:
            s = await m.open(
                OpenParams(model="tiny", seed=4, mode="lockstep", debug=DebugHooks(step_delay_ms=30))
            )
            inbox = Inbox()
            s.activate(inbox)
            original = await stepped(s, inbox, SCRIPT[:3])
            for i, a in enumerate(SCRIPT[3:7]):
                s.step(20 + i, a)
            await s.rewind(30, 2)
            kinds = [type(e).__name__ for e in inbox.events[3:]]
            assert kinds[-2:] == ["CancelledEvent", "ReadyEvent"] and set(kinds[:-2]) <= {"FramesEvent"}
            (cancel,) = inbox.of(CancelledEvent)
            assert cancel.seq == 30 and cancel.chunk == 4 + len(kinds) - 2
            assert inbox.of(ReadyEvent)[0].chunk == 2
            assert same(await stepped(s, inbox, SCRIPT[2:3], 40), original[2:3])

    run(main())


def test_a_realtime_session_rewinds_and_goes_on_from_there(worlds):
    async def main():
        async with running(worlds, retention=4) as m:
            s = await m.open(OpenParams(model="tiny", seed=9, mode="realtime", max_ahead=1))
            inbox = Inbox()
            s.activate(inbox)
            first = []
            while len(first) < 4:
                (ev,) = (await inbox.wait_for(FramesEvent, len(first) + 1))[len(first) :]
                first.append(ev)
                s.ack(ev.chunk)
            s.pause()
            await asyncio.sleep(0.3)  # the chunk in flight commits
            await s.rewind(1, 2)
            ready = inbox.of(ReadyEvent)[-1]
            assert ready.chunk == 2 and np.array_equal(ready.frame, first[1].frames[-1])
            s.resume()
            n = len(inbox.of(FramesEvent))
            (again,) = (await inbox.wait_for(FramesEvent, n + 1))[n : n + 1]
            assert again.chunk == 3 and np.array_equal(again.frames, first[2].frames)  # idle input both times

    run(main())

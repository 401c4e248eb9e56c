"""A session handed over from one manager to another (a cluster drain, web/cluster/): same id
and token, its unacked chunks kept, and every later chunk as if it had never moved."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sessions.errors import InvalidInput, RateLimited
from sessions.events import FramesEvent
from sessions.manager import OpenParams
from sessions.session import SessionStatus
from tests.sessions.conftest import Inbox, running
from tests.sessions.test_saved import STEPS, _reference, _steps


def test_a_handed_over_session_goes_on_elsewhere_bit_for_bit(worlds) -> None:
    async def main() -> None:
        want = await _reference(worlds, "tiny", 5)
        async with running(worlds, new_token=lambda: "mine." + "x" * 8) as a, running(worlds) as b:
            s = await a.open(OpenParams(model="tiny", seed=5, mode="lockstep"))
            assert s.resume_token == "mine.xxxxxxxx" and a.has_token(s.resume_token)
            inbox = Inbox()
            s.activate(inbox)
            first = await _steps(s, inbox, STEPS[:2])
            s.ack(1)  # chunk 2 stays unacked
            data = await a.hand_over(s)
            with pytest.raises(RateLimited):
                s.step(9, STEPS[2])  # held: nothing more happens on the old side
            moved = await b.take_over(s.id, data)
            with pytest.raises(InvalidInput):
                await b.take_over(s.id, data)  # twice: refused
            s.finish(SessionStatus.SHUTDOWN)
            assert b.by_token(s.resume_token) is moved and b.has_token(s.resume_token)
            assert not a.has_token(s.resume_token) and moved.id == s.id
            inbox2 = Inbox()
            resent = moved.activate(inbox2)
            assert [e.chunk for e in resent if isinstance(e, FramesEvent)] == [2]
            rest = await _steps(moved, inbox2, STEPS[2:], first_seq=2)
            got = [e.frames for e in first + rest]
            assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
            assert len(inbox.of(FramesEvent)) == 2  # the held session generated nothing more

    asyncio.run(main())


def test_a_checkpoint_keeps_steps_for_after_it_and_the_session_goes_on(worlds) -> None:
    async def main() -> None:
        want = await _reference(worlds, "tiny", 6)
        async with running(worlds) as a, running(worlds) as b:
            s = await a.open(OpenParams(model="tiny", seed=6, mode="lockstep"))
            inbox = Inbox()
            s.activate(inbox)
            first = await _steps(s, inbox, STEPS[:2])
            await s.hold(defer_steps=True)  # as `checkpoint` does, held across a step
            s.step(2, STEPS[2])  # kept, not refused
            await asyncio.sleep(0.2)
            assert len(inbox.of(FramesEvent)) == 2
            s.unhold(defer_steps=True)
            data, chunk = await a.checkpoint(s)
            assert chunk == 3  # the kept step ran before the checkpoint's own hold
            later = await _steps(s, inbox, STEPS[3:], first_seq=3)
            got = [e.frames for e in first] + [inbox.of(FramesEvent)[2].frames] + [e.frames for e in later]
            assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
            back = await b.take_over(s.id, data)  # the checkpoint restores at its chunk
            assert back.last_chunk == 3 and b.has_token(s.resume_token)

    asyncio.run(main())

"""Sessions over a real engine thread: modes, credits, cancel, pause, resume after detach,
fork, reset, TTL, limits, and one-shot == lockstep."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from models.actions import MAX_ACTION_VALUE, FrameAction
from runtime.requests import DebugHooks
from sessions.actions import ActionBuffer
from sessions.errors import InvalidInput, SessionBusy, SessionNotFound
from sessions.events import CancelledEvent, ClosedEvent, ErrorEvent, FramesEvent, ReadyEvent
from sessions.manager import OpenParams
from sessions.session import SessionStatus
from tests.sessions.conftest import Inbox, running

W = [FrameAction(frozenset({"w"}))]
D = [FrameAction(frozenset({"d"}))]


def run(coro):
    return asyncio.run(coro)


def test_realtime_is_paced_by_credits(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(seed=1, max_ahead=2))
            inbox = Inbox()
            s.activate(inbox)
            s.act(0, ["w"], (3.0, 0.0), [0.5, -0.5])
            await inbox.wait_for(FramesEvent, 2)
            await asyncio.sleep(0.5)  # no ack: nothing more may come
            assert [e.chunk for e in inbox.of(FramesEvent)] == [1, 2]
            assert s.outstanding == 0
            s.ack(1)
            frames = await inbox.wait_for(FramesEvent, 3)
            assert frames[2].chunk == 3 and frames[0].action_seq == 0
            with pytest.raises(InvalidInput):
                s.ack(99)

    run(main())


def test_pause_and_resume(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(seed=1, max_ahead=64))
            inbox = Inbox()
            s.activate(inbox)
            await inbox.wait_for(FramesEvent, 1)
            s.pause()
            await asyncio.sleep(0.1)
            while s.outstanding:  # the chunks in flight still commit
                await asyncio.sleep(0.02)
            n = len(inbox.of(FramesEvent))
            await asyncio.sleep(0.4)
            assert len(inbox.of(FramesEvent)) == n
            s.resume()
            await inbox.wait_for(FramesEvent, n + 1)

    run(main())


def test_cancel_rolls_back_the_chunk_in_flight(worlds):
    async def main():
        async with running(worlds, allow_debug_hooks=True) as m:
            s = await m.open(OpenParams(seed=2, mode="lockstep", debug=DebugHooks(step_delay_ms=60)))
            inbox = Inbox()
            s.activate(inbox)
            s.step(0, W)
            await inbox.wait_for(FramesEvent, 1)
            s.step(1, D)
            await asyncio.sleep(0.1)  # mid-denoise
            s.cancel(7)
            (c,) = await inbox.wait_for(CancelledEvent)
            assert (c.seq, c.chunk) == (7, 2)
            info = await m.engine.info(s.id)
            assert info.chunks == 1
            s.step(2, D)  # the session works right after
            frames = await inbox.wait_for(FramesEvent, 2)
            assert frames[1].chunk == 2
            s.cancel(8)  # nothing in flight: answered at once
            assert inbox.of(CancelledEvent)[-1].chunk == 3

    run(main())


def test_cancel_names_the_first_chunk_that_did_not_commit_with_steps_queued(worlds):
    # The running chunk's cancel and the queued chunks' cancels resolve in any order; the answer
    # is the first chunk that did not commit (here 1: chunk 1 was mid-denoise).
    async def main():
        async with running(worlds, allow_debug_hooks=True) as m:
            s = await m.open(OpenParams(seed=2, mode="lockstep", debug=DebugHooks(step_delay_ms=60)))
            inbox = Inbox()
            s.activate(inbox)
            for seq in range(3):
                s.step(seq, W)
            await asyncio.sleep(0.1)  # chunk 1 mid-denoise, 2 and 3 queued
            s.cancel(9)
            (c,) = await inbox.wait_for(CancelledEvent)
            assert (c.seq, c.chunk) == (9, 1) and not inbox.of(FramesEvent)
            s.step(3, D)
            (f,) = await inbox.wait_for(FramesEvent)
            assert f.chunk == 1

    run(main())


async def lockstep_frames(m, script, seed=3, model="tiny"):
    s = await m.open(OpenParams(model=model, seed=seed, mode="lockstep"))
    inbox = Inbox()
    s.activate(inbox)
    for i, a in enumerate(script):
        s.step(i, a)
    frames = await inbox.wait_for(FramesEvent, len(script))
    await m.close(s)
    return frames


def test_resume_after_detach_loses_and_repeats_nothing(worlds):
    script = [W, D, W, D, W]

    async def main():
        async with running(worlds) as m:
            reference = [e.frames for e in await lockstep_frames(m, script)]
            s = await m.open(OpenParams(seed=3, mode="lockstep"))
            first = Inbox()
            s.activate(first)
            for i, a in enumerate(script[:3]):
                s.step(i, a)
            await first.wait_for(FramesEvent, 1)
            s.ack(1)  # the client showed chunk 1, then lost its socket
            s.detach()
            while s.outstanding:  # chunks 2 and 3 commit while nobody listens
                await asyncio.sleep(0.02)
            assert m.by_token(s.resume_token) is s and s.status is SessionStatus.DETACHED
            second = Inbox()
            resent = s.activate(second)
            for i, a in enumerate(script[3:], start=3):
                s.step(i, a)
            await second.wait_for(FramesEvent, 2)
            seen = {e.chunk: e.frames for e in first.of(FramesEvent) if e.chunk <= 1}
            for e in [*resent, *second.of(FramesEvent)]:
                assert e.chunk not in seen
                seen[e.chunk] = e.frames
            assert sorted(seen) == [1, 2, 3, 4, 5]
            for i, ref in enumerate(reference, start=1):
                assert np.array_equal(seen[i], ref)

    run(main())


def test_fork_then_same_actions_same_frames(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(seed=4, mode="lockstep"))
            a = Inbox()
            s.activate(a)
            s.step(0, W)
            await a.wait_for(FramesEvent, 1)
            f = await m.fork(s)
            assert f.id != s.id and f.resume_token != s.resume_token and f.last_chunk == 1
            b = Inbox()
            assert f.activate(b) == []
            s.step(1, D)
            f.step(1, D)
            fa = (await a.wait_for(FramesEvent, 2))[1]
            fb = (await b.wait_for(FramesEvent, 1))[0]
            assert fa.chunk == fb.chunk == 2 and np.array_equal(fa.frames, fb.frames)
            s.step(2, W)
            f.step(2, D)
            fa = (await a.wait_for(FramesEvent, 3))[2]
            fb = (await b.wait_for(FramesEvent, 2))[1]
            assert not np.array_equal(fa.frames, fb.frames)

    run(main())


def test_reset_keeps_numbering_and_announces_ready(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(model="tiny-image", seed=5, mode="lockstep"))
            start = s.frame
            assert start.shape == (32, 32, 3) and s.frames_out == 1  # the start image is frame 0
            inbox = Inbox()
            s.activate(inbox)
            s.step(0, W)
            (first,) = await inbox.wait_for(FramesEvent, 1)
            assert first.chunk == 1 and first.frame0 == 1  # chunk 1 is the first generated chunk
            assert np.array_equal(s.frame, first.frames[-1])
            await m.reset(s, seq=1, seed=6)
            (ready,) = await inbox.wait_for(ReadyEvent)
            assert ready.chunk == 1 and ready.frame.shape == (32, 32, 3)
            assert not np.array_equal(ready.frame, start)  # a new seed: a new start image
            assert len(inbox.of(FramesEvent)) == 1  # nothing was generated unasked
            s.step(2, W)
            frames = await inbox.wait_for(FramesEvent, 2)
            # the new world's start frame takes one frame number, its chunk 1 the next ones
            assert frames[1].chunk == 2 and frames[1].frame0 == first.frame0 + first.frames.shape[0] + 1

    run(main())


def test_oneshot_equals_lockstep(worlds):
    script = [W, D, [FrameAction(frozenset({"a"}), (1.0, 2.0), (0.1, 0.2))]]

    async def main():
        async with running(worlds) as m:
            reference = await lockstep_frames(m, [*script, []], seed=8, model="tiny-image")
            inbox = Inbox()
            done = await m.generate(OpenParams(model="tiny-image", seed=8), script, chunks=4, sink=inbox)
            got = inbox.of(FramesEvent)
            assert done.chunks == len(got) == 4 and done.frames == sum(e.frames.shape[0] for e in got)
            assert isinstance(inbox.events[0], ReadyEvent) and inbox.events[0].frame.shape == (32, 32, 3)
            for x, y in zip(got, reference, strict=True):
                assert x.chunk == y.chunk and np.array_equal(x.frames, y.frames)
            assert len(m) == 0 and "denoise" in done.timings

    run(main())


def test_oneshot_asks_for_each_chunk_only_when_the_consumer_has_room(worlds):
    async def main():
        async with running(worlds) as m:
            inbox = Inbox()
            gate = asyncio.Event()
            asked: list[int] = []

            async def room() -> None:  # the consumer lets exactly one chunk through, then blocks
                asked.append(len(inbox.of(FramesEvent)))
                if len(asked) > 1:
                    await gate.wait()

            task = asyncio.create_task(m.generate(OpenParams(seed=3), [], chunks=3, sink=inbox, room=room))
            await inbox.wait_for(FramesEvent, 1)
            await asyncio.sleep(0.3)  # the engine would have made all 3 by now if nothing held it
            assert len(inbox.of(FramesEvent)) == 1 and len(asked) == 2
            gate.set()
            done = await task
            assert done.chunks == 3 and len(asked) == 3

    run(main())


def test_limits_ttl_and_bad_input(worlds):
    async def main():
        async with running(worlds, max_sessions=2, detach_ttl_s=5) as m:
            with pytest.raises(SessionNotFound):
                await m.open(OpenParams(model="nope"))
            with pytest.raises(InvalidInput):
                await m.open(OpenParams(debug=DebugHooks(step_delay_ms=1)))
            with pytest.raises(InvalidInput):
                await m.open(OpenParams(prompt="a castle"))
            a = await m.open(OpenParams())
            await m.open(OpenParams())
            with pytest.raises(SessionBusy):
                await m.open(OpenParams())
            inbox = Inbox()
            a.activate(inbox)
            with pytest.raises(InvalidInput, match="unknown keys"):
                a.act(0, ["jump"], (0, 0), None)
            with pytest.raises(InvalidInput, match="vector"):
                a.act(0, ["w"], (0, 0), [1.0])
            with pytest.raises(InvalidInput, match="lockstep"):
                a.step(0, W)
            a.detach()
            assert m.expire_detached(now=a.detached_at + 1) == []
            assert m.expire_detached(now=a.detached_at + 6) == [a.id]
            with pytest.raises(SessionNotFound):
                m.by_token(a.resume_token)
            await m.open(OpenParams())  # room again

    run(main())


def test_step_with_the_wrong_action_count_reports_invalid_field(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(mode="lockstep"))
            inbox = Inbox()
            s.activate(inbox)
            s.step(5, W * 2)  # the first chunk takes 1 or 3 frame actions
            (err,) = await inbox.wait_for(ErrorEvent)
            assert err.code == "invalid_field" and err.seq == 5 and not err.fatal
            s.step(6, W * 3)
            await inbox.wait_for(FramesEvent, 1)
            await m.close(s)
            assert isinstance(inbox.events[-1], ClosedEvent) and inbox.events[-1].reason == "closed"

    run(main())


def test_lockstep_chunks_committed_while_detached_are_all_resent(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(seed=1, mode="lockstep"))
            s.activate(Inbox())
            for i in range(7):
                s.step(i, W)
            s.detach()  # nothing acked, nothing delivered
            while s.outstanding:
                await asyncio.sleep(0.02)
            resent = s.activate(Inbox())
            assert [e.chunk for e in resent] == [1, 2, 3, 4, 5, 6, 7] and all(e.resent for e in resent)
            await m.close(s)
            with pytest.raises(SessionNotFound):
                s.ack(1)

    run(main())


def test_out_of_range_actions_are_refused_and_the_world_is_untouched(worlds):
    async def main():
        async with running(worlds) as m:
            s = await m.open(OpenParams(seed=3, mode="realtime"))
            for mouse, vector, field in [((1e39, 0.0), None, "mouse"), ((0.0, 0.0), [1e300, 0.0], "vector")]:
                with pytest.raises(InvalidInput) as err:
                    s.act(1, [], mouse, vector)
                assert err.value.field == field
            with pytest.raises(InvalidInput):
                s.step(1, [FrameAction(mouse=(float("inf"), 0.0))])

    run(main())


def test_summed_mouse_motion_stays_in_range():
    buf = ActionBuffer()
    for seq in range(5):
        buf.push(seq, frozenset(), (MAX_ACTION_VALUE, -MAX_ACTION_VALUE), None)
    actions, _ = buf.take(1)
    assert actions[0].mouse == (MAX_ACTION_VALUE, -MAX_ACTION_VALUE)

"""Every outstanding chunk is answered when a session resets, forks or closes: a lockstep step by
exactly one `frames`, or a `cancelled` covering it (numbered as a `cancel` would be), or the
session's `closed` (issue 39, item 3). Races are steered through the engine thread, not timed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from models.actions import FrameAction
from runtime.engine import EngineThread
from runtime.requests import ChunkCommitted, DebugHooks, Outcome
from sessions.events import CancelledEvent, ClosedEvent, FramesEvent, ReadyEvent
from sessions.manager import OpenParams
from sessions.session import MAX_STEPS_QUEUED, Session
from tests.sessions.conftest import Inbox, running

W = [FrameAction(frozenset({"w"}))]


def run(coro):
    return asyncio.run(coro)


class Gate:
    """A boundary hook that stops the engine thread at one boundary of the n-th chunk it runs
    until the test opens it."""

    def __init__(self, chunk: int, boundary: str = "denoise:1") -> None:
        self.chunk, self.boundary = chunk, boundary
        self.started = 0
        self.reached = threading.Event()
        self.opened = threading.Event()

    def __call__(self, stream_id: str, name: str) -> None:
        if name == "denoise:0":
            self.started += 1
        if name == self.boundary and self.started == self.chunk and not self.opened.is_set():
            self.reached.set()
            assert self.opened.wait(30), "the test never opened the gate"

    async def wait(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 30)


class SteeredThread(EngineThread):
    """An engine thread whose next delivery of a commit can be held (the engine thread waits
    before handing it to the loop), or followed by a loop callback that runs before the
    outcome's own callbacks (the commit is on its way to the session)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold = False
        self.held = threading.Event()
        self.release = threading.Event()
        self.then: Callable[[], None] | None = None

    def _deliver(self, outcomes: list[Outcome]) -> None:
        commit = any(isinstance(o, ChunkCommitted) for o in outcomes)
        if commit and self.hold:
            self.hold = False
            self.held.set()
            assert self.release.wait(30), "the test never released the delivery"
        if not commit or self.then is None:
            super()._deliver(outcomes)
            return
        fn, self.then = self.then, None
        with self._flock:  # as EngineThread._deliver, but one loop callback sets them and runs fn
            entries = [(e[1], o) for o in outcomes if (e := self._futures.pop(o.request_id, None))]

        def hand_over() -> None:
            for fut, outcome in entries:
                fut.set_result(outcome)  # schedules the session's callbacks; fn runs before them
            fn()

        self.loop.call_soon_threadsafe(hand_over)


def answered(inbox: Inbox, steps: int) -> tuple[list[FramesEvent], CancelledEvent]:
    """The frames and the one `cancelled` that came before the reset's `ready`, checked to answer
    all `steps` steps: frames for chunks 1..k, then `cancelled` naming chunk k + 1."""
    ready = next(i for i, e in enumerate(inbox.events) if isinstance(e, ReadyEvent))
    before = inbox.events[:ready]
    frames = [e for e in before if isinstance(e, FramesEvent)]
    cancels = [e for e in before if isinstance(e, CancelledEvent)]
    assert len(frames) + len(cancels) == len(before) and len(cancels) == 1, before
    assert before[-1] is cancels[0]  # frames first: the cancelled names what did not commit
    assert [f.chunk for f in frames] == list(range(1, len(frames) + 1))
    assert cancels[0].chunk == len(frames) + 1 and len(frames) < steps
    assert inbox.events[ready].chunk == len(frames)
    return frames, cancels[0]


async def lockstep(m, steps: int = 0) -> tuple[Session, Inbox]:
    """A lockstep session (seed 1) attached to a fresh inbox, with `steps` steps sent."""
    s = await m.open(OpenParams(seed=1, mode="lockstep"))
    inbox = Inbox()
    s.activate(inbox)
    for seq in range(steps):
        s.step(seq, W)
    return s, inbox


def test_reset_with_eight_steps_queued_cancels_them_before_ready(worlds):
    gate = Gate(chunk=1)

    async def main():
        async with running(worlds, hook=gate) as m:
            s, inbox = await lockstep(m, MAX_STEPS_QUEUED)
            await gate.wait()  # chunk 1 mid-denoise, 2..8 queued
            reset = asyncio.create_task(m.reset(s, seq=50, seed=2))
            await asyncio.sleep(0)  # the reset's cancel is immediate; its world comes after
            gate.opened.set()
            await reset
            assert answered(inbox, MAX_STEPS_QUEUED)[1] == CancelledEvent(50, 1)
            assert inbox.events[-1] == ReadyEvent(0)
            s.step(60, W)  # the new world's first chunk takes the first free number
            frames = await inbox.wait_for(FramesEvent)
            assert [f.chunk for f in frames] == [1] and frames[0].action_seq == 60

    run(main())


def test_reset_after_commits_names_the_first_chunk_that_did_not_commit(worlds):
    gate = Gate(chunk=3)

    async def main():
        async with running(worlds, hook=gate) as m:
            s, inbox = await lockstep(m, 5)
            await gate.wait()  # chunks 1, 2 committed, 3 mid-denoise, 4, 5 queued
            await inbox.wait_for(FramesEvent, 2)
            reset = asyncio.create_task(m.reset(s, seq=50, seed=2))
            await asyncio.sleep(0)
            gate.opened.set()
            await reset
            frames, cancelled = answered(inbox, 5)
            assert len(frames) == 2 and cancelled == CancelledEvent(50, 3)
            s.step(6, W)
            assert (await inbox.wait_for(FramesEvent, 3))[2].chunk == 3

    run(main())


def test_a_chunk_committed_as_the_reset_came_is_delivered_before_the_cancel(worlds):
    # The engine committed chunk 1 and is about to hand it over when the reset aborts the
    # stream: the chunk is the old world's, so its frames come, then `cancelled` for 2, `ready` 1.
    async def main():
        async with running(worlds, thread=SteeredThread, allow_debug_hooks=True) as m:
            et: SteeredThread = m.engine
            s = await m.open(OpenParams(seed=1, mode="lockstep", debug=DebugHooks(step_delay_ms=20)))
            inbox = Inbox()
            s.activate(inbox)
            et.hold = True
            s.step(0, W)
            s.step(1, W)
            assert await asyncio.to_thread(et.held.wait, 30)
            reset = asyncio.create_task(m.reset(s, seq=50, seed=2))
            await asyncio.sleep(0)
            et.release.set()
            await reset
            frames, cancelled = answered(inbox, 2)
            assert [f.action_seq for f in frames] == [0] and cancelled == CancelledEvent(50, 2)

    run(main())


def test_a_cancel_as_a_commit_is_on_its_way_comes_after_its_frames(worlds):
    # The step's commit has left the engine (nothing of the stream is left there) but has not
    # reached the session: the cancel must wait for it, not name chunk 1 at once.
    async def main():
        async with running(worlds, thread=SteeredThread) as m:
            et: SteeredThread = m.engine
            s, inbox = await lockstep(m)
            et.then = lambda: s.cancel(9)
            s.step(0, W)
            (c,) = await inbox.wait_for(CancelledEvent)
            assert [type(e) for e in inbox.events] == [FramesEvent, CancelledEvent]
            assert inbox.events[0].chunk == 1 and c == CancelledEvent(9, 2)

    run(main())


def test_a_realtime_reset_cancels_the_chunks_in_flight_like_a_cancel(worlds):
    gate = Gate(chunk=2)

    async def main():
        async with running(worlds, hook=gate) as m:
            s = await m.open(OpenParams(seed=1, max_ahead=8))
            inbox = Inbox()
            s.activate(inbox)
            await gate.wait()  # chunk 1 committed (or on its way), 2 mid-denoise
            reset = asyncio.create_task(m.reset(s, seq=50, seed=2))
            await asyncio.sleep(0)
            gate.opened.set()
            await reset
            frames, cancelled = answered(inbox, 3)
            assert len(frames) == 1 and cancelled == CancelledEvent(50, 2)
            more = await inbox.wait_for(FramesEvent, 2)  # the new world goes on from chunk 2
            assert more[1].chunk == 2

    run(main())


def test_reset_with_nothing_outstanding_is_answered_by_ready_alone(worlds):
    async def main():
        async with running(worlds) as m:
            s, inbox = await lockstep(m)
            s.step(0, W)
            await inbox.wait_for(FramesEvent)
            await m.reset(s, seq=50, seed=2)
            assert [type(e) for e in inbox.events] == [FramesEvent, ReadyEvent]

    run(main())


def test_fork_leaves_the_sources_outstanding_steps_running(worlds):
    gate = Gate(chunk=2)

    async def main():
        async with running(worlds, hook=gate) as m:
            s, inbox = await lockstep(m, MAX_STEPS_QUEUED)
            await gate.wait()
            fork = asyncio.create_task(m.fork(s))
            await asyncio.sleep(0)
            gate.opened.set()
            copy = await fork
            frames = await inbox.wait_for(FramesEvent, MAX_STEPS_QUEUED)
            assert [f.chunk for f in frames] == list(range(1, MAX_STEPS_QUEUED + 1))
            assert [f.action_seq for f in frames] == list(range(MAX_STEPS_QUEUED))
            assert not inbox.of(CancelledEvent)
            assert 1 <= copy.last_chunk < MAX_STEPS_QUEUED  # the committed world when it was copied
            theirs, base = Inbox(), copy.last_chunk
            copy.activate(theirs)
            copy.step(0, W)
            (f,) = await theirs.wait_for(FramesEvent)
            assert f.chunk == base + 1

    run(main())


@pytest.mark.parametrize("pending", ["cancel", "reset"])
def test_close_answers_a_waiting_cancel_or_reset_before_closed(worlds, pending):
    gate = Gate(chunk=1)

    async def main():
        async with running(worlds, hook=gate) as m:
            s, inbox = await lockstep(m, 3)
            await gate.wait()
            if pending == "cancel":
                s.cancel(9)
            else:
                reset = asyncio.create_task(m.reset(s, seq=9, seed=2))
                await asyncio.sleep(0)
            await m.close(s)
            gate.opened.set()
            if pending == "reset":
                await reset  # no `ready`: the session is over
            assert inbox.events == [CancelledEvent(9, 1), ClosedEvent("closed")]

    run(main())


def test_close_with_steps_queued_ends_with_closed(worlds):
    gate = Gate(chunk=2)

    async def main():
        async with running(worlds, hook=gate) as m:
            s, inbox = await lockstep(m, MAX_STEPS_QUEUED)
            await gate.wait()
            await inbox.wait_for(FramesEvent)
            await m.close(s)
            gate.opened.set()
            while m.engine.outstanding(s.id):  # every chunk resolved in the engine
                await asyncio.sleep(0.01)
            assert [type(e) for e in inbox.events] == [FramesEvent, ClosedEvent]

    run(main())

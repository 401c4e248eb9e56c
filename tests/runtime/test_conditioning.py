"""Conditioning off the engine thread (runtime/conditioning.py): an open or reset of a world with
heavy conditioning never holds another session's chunk; a session closed meanwhile leaves
nothing behind; an error in it is that session's.

The worlds here start from an image (`World.heavy_conditioning`); their start image is a gate
that blocks one seed's conditioning until the test releases it, so what overlaps what is decided
by events, not by timing."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from models.world import Conditioning, World
from runtime.conditioning import CONDITIONING_NICE
from runtime.engine import Engine, EngineThread, StreamInfo
from runtime.errors import CapacityError, EngineDeadError, StreamNotFound
from runtime.requests import ChunkCommitted, ChunkRequest

from .conftest import committed, small_world

GATED = 99  # the seed whose conditioning waits for the gate
FAILING = 13  # the seed whose conditioning raises
HANG_GUARD_S = 60.0  # only ever reached when the behaviour under test is broken


class Gate:
    """A world's start image that blocks seed GATED until released and fails seed FAILING."""

    def __init__(self, world: World) -> None:
        self.inner = world._start_image
        assert self.inner is not None
        self.started = threading.Event()
        self.release = threading.Event()
        world._start_image = self

    def __call__(self, seed: int) -> np.ndarray:
        if seed == FAILING:
            raise RuntimeError("the start image could not be read")
        if seed == GATED:
            self.started.set()
            assert self.release.wait(HANG_GUARD_S)
        return self.inner(seed)


@pytest.fixture
def gated() -> tuple[World, Gate]:
    world = small_world(image_start=True, name="img")
    return world, Gate(world)


class Answers(dict):
    """Replies of `open_stream` / `begin_reset` by stream id."""

    def to(self, stream_id: str) -> Callable[[StreamInfo | Exception], None]:
        def reply(answer: StreamInfo | Exception) -> None:
            assert stream_id not in self, "answered twice"
            self[stream_id] = answer

        return reply


def step_until(engine: Engine, done: Callable[[], bool]) -> list:
    """Step the engine (waiting briefly while it is idle) until `done()`."""
    outcomes: list = []
    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        assert time.monotonic() < deadline, "hang guard"
        if engine.has_work():
            outcomes += engine.step()
        else:
            time.sleep(0.01)
    return outcomes


def opened(engine: Engine, answers: Answers, stream_id: str, seed: int) -> StreamInfo:
    engine.open_stream(stream_id, "img", Conditioning(seed=seed), None, answers.to(stream_id))
    step_until(engine, lambda: stream_id in answers)
    info = answers.pop(stream_id)
    assert isinstance(info, StreamInfo), info
    return info


def worker_idle(engine: Engine) -> bool:
    assert engine.conditioning is not None
    return engine.conditioning.jobs == 0


# -- the engine thread goes on --------------------------------------------------------------------


def test_a_chunk_commits_while_another_sessions_open_is_conditioning(gated):
    world, gate = gated

    async def main():
        engine = Engine({"img": world}, max_batch=2)
        et = EngineThread(engine, asyncio.get_running_loop())
        et.start()
        try:
            await et.add_stream("a", "img", Conditioning(seed=1))
            opening = et.add_stream("b", "img", Conditioning(seed=GATED))
            assert await asyncio.to_thread(gate.started.wait, HANG_GUARD_S)
            out = await asyncio.wait_for(et.submit(ChunkRequest("a", et.new_request_id())), HANG_GUARD_S)
            assert isinstance(out, ChunkCommitted) and out.chunk == 1
            assert not opening.done()  # b's conditioning is still running: a did not wait for it
            gate.release.set()
            info = await asyncio.wait_for(opening, HANG_GUARD_S)
            assert info.stream_id == "b" and info.chunks == 0 and info.frame is not None
            out = await asyncio.wait_for(et.submit(ChunkRequest("b", et.new_request_id())), HANG_GUARD_S)
            assert isinstance(out, ChunkCommitted) and out.chunk == 1
        finally:
            gate.release.set()
            et.close()

    asyncio.run(main())


def test_a_chunk_commits_while_another_sessions_reset_is_conditioning(gated):
    world, gate = gated

    async def main():
        engine = Engine({"img": world}, max_batch=2)
        et = EngineThread(engine, asyncio.get_running_loop())
        et.start()
        try:
            await et.add_stream("a", "img", Conditioning(seed=1))
            await et.add_stream("b", "img", Conditioning(seed=2))
            out = await et.submit(ChunkRequest("b", et.new_request_id()))
            assert isinstance(out, ChunkCommitted)
            resetting = et.reset_stream("b", Conditioning(seed=GATED))
            assert await asyncio.to_thread(gate.started.wait, HANG_GUARD_S)
            out = await asyncio.wait_for(et.submit(ChunkRequest("a", et.new_request_id())), HANG_GUARD_S)
            assert isinstance(out, ChunkCommitted)
            assert not resetting.done()
            gate.release.set()
            info = await asyncio.wait_for(resetting, HANG_GUARD_S)
            assert info.chunks == 0  # the new world
        finally:
            gate.release.set()
            et.close()

    asyncio.run(main())


def test_an_installed_world_is_the_one_built_inline(gated):
    """The conditioning computed on the worker gives the world `add_stream` builds in place."""
    world, _ = gated
    engine, answers = Engine({"img": world}), Answers()
    opened(engine, answers, "off", seed=5)
    engine.add_stream("inline", "img", Conditioning(seed=5))
    # by default the worker holds as many jobs as the budget admits sessions (max_streams 16)
    assert engine.conditioning is not None and engine.conditioning.max_jobs == 16
    a, b = committed(engine, "off"), committed(engine, "inline")
    assert np.array_equal(a.frames, b.frames)
    engine.close()


def test_a_world_without_heavy_conditioning_opens_at_once():
    world = small_world(name="plain")
    assert not world.heavy_conditioning
    engine, answers = Engine({"plain": world}), Answers()
    engine.open_stream("s", "plain", Conditioning(seed=1), None, answers.to("s"))
    assert isinstance(answers["s"], StreamInfo)  # answered inside the call
    engine.begin_reset("s", Conditioning(seed=2), answers.to("r"))
    assert isinstance(answers["r"], StreamInfo)
    assert engine.conditioning is not None and engine.conditioning._thread is None  # never started
    engine.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_the_worker_thread_runs_at_a_lower_cpu_priority(gated):
    world, gate = gated
    engine, answers = Engine({"img": world}), Answers()
    engine.open_stream("b", "img", Conditioning(seed=GATED), None, answers.to("b"))
    assert gate.started.wait(HANG_GUARD_S)
    assert engine.conditioning is not None and engine.conditioning._thread is not None
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = os.getpriority(os.PRIO_PROCESS, engine.conditioning._thread.native_id)
    assert worker == min(19, ours + CONDITIONING_NICE) > ours
    gate.release.set()
    engine.close()


# -- close / remove while conditioning --------------------------------------------------------------


def test_removing_a_stream_whose_open_is_conditioning_leaves_nothing(gated):
    world, gate = gated
    engine, answers = Engine({"img": world}), Answers()
    opened(engine, answers, "a", seed=1)
    free_rows = world.free_rows
    engine.open_stream("b", "img", Conditioning(seed=GATED), None, answers.to("b"))
    assert gate.started.wait(HANG_GUARD_S)
    assert len(engine.memory) == 2  # b's bytes are held while it is prepared
    engine.remove_stream("b")
    assert isinstance(answers.pop("b"), StreamNotFound)
    assert len(engine.memory) == 1 and not engine.preparing("b")
    gate.release.set()
    step_until(engine, lambda: worker_idle(engine))
    engine.step()  # nothing to install: its result was dropped
    assert "b" not in engine.runner.streams and world.free_rows == free_rows and not answers
    opened(engine, answers, "b", seed=2)  # the id is free again
    committed(engine, "a")
    engine.close()


def test_removing_a_stream_whose_reset_is_conditioning_frees_its_row(gated):
    world, gate = gated
    engine, answers = Engine({"img": world}), Answers()
    opened(engine, answers, "a", seed=1)
    free_rows = world.free_rows
    engine.begin_reset("a", Conditioning(seed=GATED), answers.to("a"))
    assert gate.started.wait(HANG_GUARD_S)
    engine.remove_stream("a")
    assert isinstance(answers.pop("a"), StreamNotFound)
    gate.release.set()
    step_until(engine, lambda: worker_idle(engine))
    engine.step()
    assert world.free_rows == free_rows + 1 and len(engine.memory) == 0 and not answers
    engine.close()


def test_closing_the_engine_answers_what_is_still_conditioning(gated):
    world, gate = gated
    engine, answers = Engine({"img": world}), Answers()
    engine.open_stream("b", "img", Conditioning(seed=GATED), None, answers.to("b"))
    assert gate.started.wait(HANG_GUARD_S)
    gate.release.set()
    assert engine.close()  # joins the worker: its job's result is dropped
    assert isinstance(answers["b"], EngineDeadError)
    assert len(engine.memory) == 0 and world.free_rows == world.max_sessions
    assert engine.conditioning is not None and not engine.conditioning._thread.is_alive()


# -- errors and refusals --------------------------------------------------------------------------


def test_an_error_in_conditioning_fails_only_its_session(gated):
    world, _ = gated
    engine, answers = Engine({"img": world}), Answers()
    opened(engine, answers, "a", seed=1)
    engine.open_stream("b", "img", Conditioning(seed=FAILING), None, answers.to("b"))
    step_until(engine, lambda: "b" in answers)
    assert isinstance(answers.pop("b"), RuntimeError)
    assert len(engine.memory) == 1 and "b" not in engine.runner.streams
    engine.begin_reset("a", Conditioning(seed=FAILING), answers.to("a"))
    step_until(engine, lambda: "a" in answers)
    assert isinstance(answers.pop("a"), RuntimeError)
    assert committed(engine, "a").chunk == 1  # the old world stays and runs
    engine.close()


def test_a_full_worker_refuses_an_open_as_busy(gated):
    world, gate = gated
    engine, answers = Engine({"img": world}, max_preparing=1), Answers()
    engine.open_stream("b", "img", Conditioning(seed=GATED), None, answers.to("b"))
    assert gate.started.wait(HANG_GUARD_S)
    engine.open_stream("c", "img", Conditioning(seed=1), None, answers.to("c"))
    assert isinstance(answers.pop("c"), CapacityError)  # at once, and its bytes are not held
    assert len(engine.memory) == 1
    gate.release.set()
    step_until(engine, lambda: "b" in answers)
    assert isinstance(answers.pop("b"), StreamInfo)
    opened(engine, answers, "c", seed=1)
    engine.close()


def test_a_stream_being_reset_takes_no_chunk_and_no_fork_until_ready(gated):
    world, gate = gated
    engine, answers = Engine({"img": world}), Answers()
    opened(engine, answers, "a", seed=1)
    committed(engine, "a")
    engine.begin_reset("a", Conditioning(seed=GATED), answers.to("a"))
    assert gate.started.wait(HANG_GUARD_S)
    with pytest.raises(CapacityError, match="being reset"):
        engine.submit(ChunkRequest("a", engine.new_request_id()))
    with pytest.raises(CapacityError, match="being reset"):
        engine.fork_stream("a", "f")
    engine.begin_reset("a", Conditioning(seed=2), answers.to("again"))
    assert isinstance(answers.pop("again"), CapacityError)
    gate.release.set()
    step_until(engine, lambda: "a" in answers)
    assert isinstance(answers.pop("a"), StreamInfo)
    assert committed(engine, "a").chunk == 1  # the new world's first chunk
    engine.close()


def test_opens_prepared_together_leave_the_spare_row_for_a_reset():
    """Admitted while an earlier open is still unbound, a second open still gets a pool row of
    its own, and the spare row a reset needs stays free (runtime/memory.py)."""
    plain, image = small_world(name="plain"), small_world(image_start=True, name="img")
    engine, answers = Engine({"plain": plain, "img": image}), Answers()
    for sid in ("x", "y"):  # both admitted before either is installed
        engine.open_stream(sid, "img", Conditioning(seed=len(sid) + ord(sid)), None, answers.to(sid))
    step_until(engine, lambda: len(answers) == 2)
    assert all(isinstance(a, StreamInfo) for a in answers.values())
    engine.begin_reset("x", Conditioning(seed=3), answers.to("r"))
    step_until(engine, lambda: "r" in answers)
    assert isinstance(answers["r"], StreamInfo), answers["r"]
    engine.close()


def test_every_session_the_budget_admits_may_open_at_once(gated):
    """The worker's bound follows the budget: as many opens as sessions fit are all prepared,
    none refused (one client per session opening together, as a crowd does)."""
    world, gate = gated
    engine, answers = Engine({"img": world}, max_streams=6), Answers()
    engine.open_stream("s0", "img", Conditioning(seed=GATED), None, answers.to("s0"))
    assert gate.started.wait(HANG_GUARD_S)  # the first one holds the worker: the rest queue
    for i in range(1, 6):
        engine.open_stream(f"s{i}", "img", Conditioning(seed=i), None, answers.to(f"s{i}"))
    assert not answers  # nobody refused
    gate.release.set()
    step_until(engine, lambda: len(answers) == 6)
    assert all(isinstance(a, StreamInfo) for a in answers.values())
    engine.close()

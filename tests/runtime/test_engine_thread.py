"""EngineThread: futures on the asyncio side, control calls between steps, cancel from the loop."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from models.world import Conditioning
from runtime.engine import Engine, EngineThread
from runtime.errors import EngineDeadError, StreamNotFound
from runtime.requests import ChunkCancelled, ChunkCommitted, ChunkRequest, DebugHooks


def run(coro):
    return asyncio.run(coro)


def test_submit_resolves_on_the_loop(world):
    async def main():
        engine = Engine({"tiny": world})
        et = EngineThread(engine, asyncio.get_running_loop())
        et.start()
        try:
            info = await et.call(engine.add_stream, "s", "tiny", Conditioning(seed=1))
            assert info.chunks == 0
            futs = [et.submit(ChunkRequest("s", engine.new_request_id())) for _ in range(3)]
            outs = await asyncio.gather(*futs)
            assert [o.chunk for o in outs] == [1, 2, 3]
            assert all(isinstance(o, ChunkCommitted) for o in outs)
            with pytest.raises(StreamNotFound):
                await et.submit(ChunkRequest("missing", engine.new_request_id()))
        finally:
            et.stop()

    run(main())


def test_cancel_stream_aborts_in_flight_and_queued(world):
    async def main():
        engine = Engine({"tiny": world})
        et = EngineThread(engine, asyncio.get_running_loop())
        et.start()
        try:
            await et.call(engine.add_stream, "s", "tiny", Conditioning(seed=1), DebugHooks(step_delay_ms=50))
            futs = [et.submit(ChunkRequest("s", engine.new_request_id())) for _ in range(2)]
            await asyncio.sleep(0.08)  # the first chunk is mid-denoise
            assert et.cancel_stream("s") == 2
            outs = await asyncio.gather(*futs)
            assert all(isinstance(o, ChunkCancelled) for o in outs)
            assert sorted(o.started for o in outs) == [False, True]
            info = await et.call(engine.info, "s")
            assert info.chunks == 0
            done = await et.submit(ChunkRequest("s", engine.new_request_id()))
            assert isinstance(done, ChunkCommitted) and done.chunk == 1
        finally:
            et.stop()

    run(main())


def test_a_dead_engine_fails_every_future(world):
    async def main():
        engine = Engine({"tiny": world})
        et = EngineThread(engine, asyncio.get_running_loop())

        def boom():
            raise SystemExit("device lost")

        engine.step = boom  # type: ignore[method-assign]
        call = et.call(engine.add_stream, "s", "tiny", Conditioning())
        fut = et.submit(ChunkRequest("s", engine.new_request_id()))
        et.start()
        for pending in (call, fut):  # whether or not it ran before the death, nothing hangs
            with contextlib.suppress(EngineDeadError):
                await asyncio.wait_for(pending, 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(fut, 5)
        assert et.dead
        with pytest.raises(EngineDeadError):
            et.submit(ChunkRequest("s", engine.new_request_id()))

    run(main())


def test_a_cancel_right_after_a_submit_wins_while_another_chunk_runs(world):
    """The step waits in the engine's input queue (the engine is busy with another session's
    chunk) when the cancel arrives; the cancel must still win. A blocking hook makes it exact."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def hook(stream_id: str, name: str) -> None:
        if stream_id == "a" and name == "denoise:0":
            entered.set()
            release.wait(10)

    async def main():
        engine = Engine({"tiny": world}, boundary_hook=hook)
        et = EngineThread(engine, asyncio.get_running_loop())
        et.start()
        try:
            for sid in ("a", "b"):
                await et.call(engine.add_stream, sid, "tiny", Conditioning(seed=1))
            busy = et.submit(ChunkRequest("a", engine.new_request_id()))
            await asyncio.to_thread(entered.wait, 10)
            step = et.submit(ChunkRequest("b", engine.new_request_id()))
            assert et.cancel_stream("b") == 1
            release.set()
            out = await step
            assert isinstance(out, ChunkCancelled) and not out.started and out.chunk == 1
            assert isinstance(await busy, ChunkCommitted)
            assert (await et.call(engine.info, "b")).chunks == 0
        finally:
            release.set()
            et.stop()

    run(main())


def test_torch_threads_are_the_engine_threads_own(world):
    # `threads` is set on the engine thread; the caller's thread keeps its own count (OpenMP's
    # thread count is per thread), so only the engine runs a team of torch workers.
    async def main():
        before = torch.get_num_threads()
        et = EngineThread(Engine({"tiny": world}), asyncio.get_running_loop(), threads=before + 1)
        et.start()
        try:
            assert await et.call(torch.get_num_threads) == before + 1
            assert torch.get_num_threads() == before
        finally:
            et.stop()

    run(main())
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="at least 1"):
            EngineThread(Engine({"tiny": world}), loop, threads=0)
    finally:
        loop.close()


def test_stop_aborts_the_running_chunk_at_its_next_boundary(world):
    import threading

    inside, release = threading.Event(), threading.Event()

    def hook(stream_id: str, name: str) -> None:
        if name == "denoise:1":
            inside.set()
            release.wait(10)

    async def main():
        engine = Engine({"tiny": world}, boundary_hook=hook)
        et = EngineThread(engine, asyncio.get_running_loop())
        et.start()
        await et.call(engine.add_stream, "s", "tiny", Conditioning(seed=1))
        rid = engine.new_request_id()
        fut = et.submit(ChunkRequest("s", rid))
        await asyncio.to_thread(inside.wait, 10)
        stopping = asyncio.get_running_loop().run_in_executor(None, et.stop, 30.0)
        while not engine.is_aborted(rid) and not stopping.done():  # stop's first act
            await asyncio.sleep(0.01)
        release.set()
        assert await stopping and not et.alive
        out = await fut  # the step it was in ends, and hands its outcome over
        assert isinstance(out, ChunkCancelled) and out.started
        assert engine.info("s").chunks == 0  # rolled back at denoise:2, not run to its commit

    run(main())


# A chunk whose denoise never leaves torch (one forward longer than any stop timeout); the
# script prints "inside" once the engine thread is in it, then ends as `how` says.
_INSIDE_TORCH = """
import asyncio, sys, threading, torch
from models.world import Conditioning
from runtime import engine as E
from runtime.requests import ChunkRequest
from tests.runtime.conftest import small_world

how = sys.argv[1]
E.EXIT_GRACE_S = 0.5
world, inside = small_world(), threading.Event()
a = torch.randn(1500, 1500)

def endless(*args, **kwargs):
    inside.set()
    while True:
        a @ a

world.denoise = endless

async def main():
    engine = E.Engine({"tiny": world})
    et = E.EngineThread(engine, asyncio.get_running_loop())
    et.start()
    await et.call(engine.add_stream, "s", "tiny", Conditioning(seed=1))
    et.submit(ChunkRequest("s", engine.new_request_id()))
    await asyncio.to_thread(inside.wait, 60)
    print("inside", flush=True)
    if how == "stopped":
        assert not et.stop(0.2)

asyncio.run(main())
"""


@pytest.mark.parametrize("how, status", [("stopped", 0), ("never stopped", 1)])
def test_exiting_while_the_engine_is_inside_a_model_call_does_not_crash(how, status):
    """Interpreter exit with a daemon thread inside torch aborts the process ("terminate called
    without an active exception", -6): the engine thread's exit guard leaves first, saying so."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    script = [sys.executable, "-c", _INSIDE_TORCH, how]
    done = subprocess.run(script, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "inside", done.stderr
    assert "terminate called" not in done.stderr
    assert done.returncode == status, done.stderr
    assert f"leaving now without waiting for it (exit status {status})" in done.stderr

"""EngineThread: futures on the asyncio side, control calls between steps, cancel from the loop."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

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

"""web/sdk: the async and sync clients against a real server on loopback."""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from web import codec, convert
from web import messages as m
from web.errors import ErrorCode, ServerError, ServerUnreachable, SessionClosed, StepCancelled
from web.sdk import Client, attach, connect, generate
from web.sdk import sync as sync_sdk
from web.sdk.actions import frame_actions
from web.sdk.core import ClientCore
from web.sdk.urls import session_url

from .conftest import psnr, run, serving, serving_in_thread


def test_sdk_imports_without_torch() -> None:
    probe = (
        "import sys, web.sdk; "
        "banned = {'torch', 'sessions', 'runtime', 'models', 'diffusers'}; "
        "print(sorted(banned & {name.split('.')[0] for name in sys.modules}))"
    )
    root = Path(__file__).parents[2]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


def test_urls_and_actions() -> None:
    assert session_url("127.0.0.1:8000") == "ws://127.0.0.1:8000/v1/session"
    assert session_url("http://h:1/") == "ws://h:1/v1/session"
    assert (
        session_url("wss://h/v1/session", resume="t", codec="raw") == "wss://h/v1/session?resume=t&codec=raw"
    )
    (one,) = frame_actions({"keys": "space", "mouse": (1, 2), "vector": [0.5, 1]})
    assert one.keys == ("space",) and one.mouse == (1.0, 2.0) and one.vector.dtype == np.float32
    assert frame_actions([]) == (m.FrameAction(),)
    assert len(frame_actions([{}, {"keys": ["w"]}, m.FrameAction()])) == 3
    with pytest.raises(ValueError, match="unknown action fields"):
        frame_actions({"key": "w"})


def test_ready_frame_is_decoded_to_an_array() -> None:
    model = m.ModelInfo(
        id="w", fps=15.0, chunk_frames=4, width=8, height=4, action_space=m.ActionSpace(keys=(), mouse=False)
    )
    image = np.full((4, 8, 3), 120, np.uint8)
    jpeg = convert.ready_frame("jpeg", image)
    core = ClientCore("jpeg")
    core.receive(
        codec.encode(
            m.Ready(session_id="s", resume_token="", model=model, codec=m.CodecInfo(name="jpeg"), frame=jpeg)
        )
    )
    assert core.ready.frame.shape == (4, 8, 3) and core.ready.frame.dtype == np.uint8
    assert np.abs(core.ready.frame.astype(int) - 120).max() <= 2
    core.receive(codec.encode(m.Done(chunks=0, frames=0)))
    assert core.generated(m.Done(chunks=0, frames=0)).start is core.ready.frame
    raw = ClientCore("raw")
    raw.receive(
        codec.encode(m.Ready(session_id="s", resume_token="t", model=model, codec=m.CodecInfo(name="raw")))
    )
    assert raw.ready.frame is None


def test_image_started_worlds_give_their_start_frame_in_ready(worlds) -> None:
    with serving_in_thread(worlds) as server:
        with Client(server.url, model="tiny-image", seed=4) as world:
            start = world.ready.frame
            assert start.shape == (32, 32, 3) and start.dtype == np.uint8
            frames = world.step({"keys": ["w"]})  # the first step's chunk is its own, not the start
            assert frames.shape == (4, 32, 32, 3) and world.core.received == 1
            assert np.array_equal(world.reset(seed=4).frame, start)  # the same seed starts the same
        g = sync_sdk.generate(server.url, model="tiny-image", chunks=1, seed=4)
        assert np.array_equal(g.start, start) and [c.chunk for c in g.chunks] == [1] and len(g.frames) == 4

    async def main():
        async with connect(server.url, model="tiny-image", seed=4, mode="lockstep", codec="jpeg") as s:
            assert s.ready.frame.shape == (32, 32, 3) and psnr(s.ready.frame, start) >= 35
            assert (await s.step({})).shape == (4, 32, 32, 3)

    with serving_in_thread(worlds) as server:
        run(main())


def test_async_lockstep_session(v1) -> None:
    async def main():
        async with v1(debug_hooks=True) as server:
            async with connect(server.url, seed=1, mode="lockstep", codec="h264") as s:
                assert s.ready.model.id == "tiny" and s.ready.codec.name == "h264"
                frames = await s.step({"keys": ["w"]})
                assert frames.shape == (3, 32, 32, 3) and frames.dtype == np.uint8
                assert (await s.step([{"keys": ["d"]}] * 4)).shape == (4, 32, 32, 3)
                with pytest.raises(ServerError) as info:
                    await s.step({"keys": ["jump"]})
                assert info.value.code is ErrorCode.INVALID_FIELD and not info.value.fatal
                assert (await s.cancel()).chunk == 3
                assert (await s.reset(seed=2)).chunk == 2
                assert (await s.step({})).shape == (3, 32, 32, 3)  # a fresh world's first chunk
                assert await s.ping() >= 0
            assert s.core.closed == "closed"

            async with connect(server.url, mode="lockstep", debug={"step_delay_ms": 40}) as slow:
                step = asyncio.create_task(slow.step({}))
                await asyncio.sleep(0.1)
                await slow.cancel()
                with pytest.raises(StepCancelled):
                    await step

    run(main())


def test_async_realtime_chunks_are_acked_and_paced(v1) -> None:
    async def main():
        async with v1() as server, connect(server.url, seed=1, max_ahead=2, codec="jpeg") as s:
            assert await s.act(keys=["w"], mouse=(2.0, 0.0), vector=[0.1, 0.2]) == 1
            chunks = []
            async for chunk in s.chunks():
                chunks.append(chunk)
                if len(chunks) == 5:
                    break
            assert [c.chunk for c in chunks] == [1, 2, 3, 4, 5]
            assert chunks[-1].action_seq == 1 and chunks[-1].frames.shape == (4, 32, 32, 3)
            await s.pause()
            await s.act(keys=["jump"])
            await asyncio.sleep(0.2)
            with pytest.raises(ServerError, match="unknown keys"):
                await s.act()  # the refused action's error surfaces at the next call
            await s.resume()
            assert (await s.next_chunk()).chunk > 5

    run(main())


def test_async_reconnect_fork_and_generate(v1) -> None:
    async def main():
        async with v1() as server:
            async with connect(server.url, seed=3, mode="lockstep", codec="raw") as ref:
                reference = [await ref.step({"keys": ["w"]}) for _ in range(3)]
            async with connect(server.url, seed=3, mode="lockstep", codec="raw") as s:
                assert np.array_equal(await s.step({"keys": ["w"]}), reference[0])
                s._ws.transport.abort()  # the network drops (disconnect() would close cleanly)
                await asyncio.sleep(0.2)
                with pytest.raises(SessionClosed):
                    await s.step({"keys": ["w"]})
                ready = await s.reconnect()
                assert ready.chunk == 1
                assert np.array_equal(await s.step({"keys": ["w"]}), reference[1])
                token = await s.fork()
                async with attach(server.url, token, codec="jpeg") as f:
                    assert f.ready.chunk == 2 and (await f.step({})).shape == (4, 32, 32, 3)
            g = await generate(server.url, chunks=3, actions=[{"keys": ["w"]}] * 3, seed=3, codec="raw")
            assert np.array_equal(g.frames, np.concatenate(reference)) and g.done.chunks == 3
            g = await generate(server.url, chunks=2, seed=3, codec="h264")  # model-size frames
            assert g.frames.shape == (7, 32, 32, 3)
            with pytest.raises(ServerError) as info:
                await generate(server.url, chunks=1, model="nope")
            assert info.value.code is ErrorCode.NOT_FOUND and info.value.fatal

    run(main())


def test_async_open_errors_raise(worlds) -> None:
    async def main():
        async with serving(worlds, token="t0k") as server:
            with pytest.raises(ServerError) as info:
                await connect(server.url)
            assert info.value.code is ErrorCode.UNAUTHORIZED
            s = await connect(server.url, token="t0k", mode="lockstep")
            await s.close()

    run(main())


def test_sync_client_waits_for_the_server_and_steps(worlds) -> None:
    box: dict = {}

    def client_first() -> None:
        while "port" not in box:
            time.sleep(0.01)
        with Client(f"127.0.0.1:{box['port']}", seed=3, connect_timeout=60) as world:
            box["ready"] = world.ready
            box["frames"] = [world.step({"keys": ["w"]}) for _ in range(2)]
            box["reset"] = world.reset(seed=3)
            box["again"] = world.step({"keys": ["w"]})
            box["token"] = world.fork()

    with serving_in_thread(worlds) as server:
        port = server.port
    # the port is free again: the client starts retrying before a server listens there
    thread = threading.Thread(target=client_first, daemon=True)
    box["port"] = port
    thread.start()
    time.sleep(1.0)
    with serving_in_thread(worlds, port=port):
        thread.join(120)
    assert box["ready"].model.id == "tiny" and box["ready"].codec.name == "raw"
    assert [f.shape for f in box["frames"]] == [(3, 32, 32, 3), (4, 32, 32, 3)]
    assert box["reset"].chunk == 2 and np.array_equal(box["again"], box["frames"][0])
    assert box["token"]


def free_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_no_server_fails_with_a_clear_connection_error() -> None:
    url = f"127.0.0.1:{free_port()}"
    want = f"no worldserve server at ws://{url}/v1/session"
    assert inspect.signature(Client).parameters["connect_timeout"].default <= 10  # documented, short
    with pytest.raises(ServerUnreachable, match=want) as info:
        Client(url, connect_timeout=0.5)
    assert isinstance(info.value, ConnectionError) and info.value.url == f"ws://{url}/v1/session"
    with pytest.raises(ServerUnreachable, match=want):
        sync_sdk.generate(url, chunks=1, connect_timeout=0.5)

    async def main():
        with pytest.raises(ServerUnreachable, match=want):
            await connect(url, connect_timeout=0.5)
        with pytest.raises(ServerUnreachable, match=want):
            await generate(url, chunks=1, connect_timeout=0.5)

    run(main())


def test_sync_realtime_generate_and_errors(worlds) -> None:
    with serving_in_thread(worlds) as server:
        with Client(server.url, mode="realtime", codec="jpeg", timeout_s=60) as world:
            world.act(keys=["d"])
            got = []
            for chunk in world.chunks():
                got.append(chunk.chunk)
                if len(got) == 3:
                    break
            assert got == [1, 2, 3]
            world.pause()
            assert world.cancel().seq > 0
            world.resume()
            assert world.next_chunk().chunk > 3
        g = sync_sdk.generate(server.url, chunks=2, actions=[[{"keys": ["w"]}]], seed=1)
        assert g.frames.shape == (7, 32, 32, 3) and [c.chunk for c in g.chunks] == [1, 2]
        with pytest.raises(ServerError) as info:
            Client(server.url, model="nope")
        assert info.value.code is ErrorCode.NOT_FOUND


def test_rewind_in_the_async_sdk(v1) -> None:
    """`rewind(n)`: the ready naming n with its last frame, then the same steps give the same
    frames under the same numbers; a step still waiting raises StepCancelled; past the retention
    `not_retained` and the session goes on."""

    async def main():
        async with v1(retention=2, debug_hooks=True) as server:
            async with connect(server.url, seed=4, mode="lockstep", codec="raw") as s:
                first = [await s.step({"keys": [k]}) for k in "wdas"]
                back = await s.rewind(2)
                assert back.chunk == 2 and np.array_equal(back.frame, first[1][-1])
                assert np.array_equal(await s.step({"keys": ["a"]}), first[2])  # chunk 3 again
                with pytest.raises(ServerError) as info:
                    await s.rewind(0)
                assert info.value.code is ErrorCode.NOT_RETAINED and not info.value.fatal
                assert np.array_equal(await s.step({"keys": ["s"]}), first[3])
            async with connect(server.url, mode="lockstep", debug={"step_delay_ms": 40}) as slow:
                await slow.step({})
                step = asyncio.create_task(slow.step({}))
                await asyncio.sleep(0.05)
                assert (await slow.rewind(1)).chunk == 1
                with pytest.raises(StepCancelled):
                    await step

    run(main())


def test_rewind_in_the_sync_sdk(worlds) -> None:
    with serving_in_thread(worlds, retention=1) as server, Client(server.url, seed=4) as world:
        a = world.step({"keys": ["w"]})
        world.step({"keys": ["d"]})
        assert world.rewind(1).chunk == 1 and np.array_equal(world.ready.frame, a[-1])

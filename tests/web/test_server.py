"""web/server.py end to end: a real server on loopback, raw protocol clients, every message type,
resume after a dropped socket, fork, one-shot, H.264 quality, a stalled client, and shutdown."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import numpy as np
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from web import codec
from web import messages as m
from web.encoders import decode_jpeg
from web.sdk import attach, connect
from web.server import Server, ServerConfig, exposure_warning

from .conftest import dial, psnr, recv, recv_until, run, send, serving

W = m.FrameAction(keys=("w",))
D = m.FrameAction(keys=("d",), mouse=(1.0, -2.0), vector=np.array([0.5, -0.5], np.float32))


async def dial_stalled(server):
    """A client that reads nothing after the handshake, with a tiny receive buffer, so that the
    server's outbound queue fills after a few chunks rather than after megabytes of kernel buffers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    ws = await ws_connect(server.ws_url, sock=sock, proxy=None, compression=None, max_size=None)
    ws.transport.pause_reading()
    return ws


async def closed_with(ws, code: int) -> None:
    try:
        while True:
            await recv(ws, 30)
    except ConnectionClosed:
        pass
    assert ws.close_code == code, (ws.close_code, ws.close_reason)


def test_lockstep_message_types(v1) -> None:
    async def main():
        async with v1() as server:
            ws = await dial(server)
            await send(ws, m.Ping(t=12.5))
            pong = await recv(ws)
            assert isinstance(pong, m.Pong) and pong.t == 12.5 and pong.server_t > 0
            await send(ws, m.Open(seed=1, mode="lockstep", codec="raw"))
            ready = await recv(ws)
            assert isinstance(ready, m.Ready) and ready.chunk == 0 and ready.protocol == 1
            assert ready.model.id == "tiny" and ready.model.width == 32 and ready.codec.name == "raw"
            assert ready.model.action_space.keys == ("w", "a", "s", "d", "space")
            assert len(ready.resume_token) >= 43  # 256 bits, urlsafe base64

            await send(ws, m.Step(seq=7, actions=[W]))
            first = await recv(ws)
            assert isinstance(first, m.Frames) and (first.chunk, first.frame0, first.action_seq) == (1, 0, 7)
            assert first.data.shape == (first.count, 32, 32, 3) and first.key
            assert {"denoise", "decode", "encode", "total"} <= set(first.timings)
            await send(ws, m.Ack(chunk=1))
            await send(ws, m.Step(seq=8, actions=[D] * 4))
            second = await recv(ws)
            assert (second.chunk, second.frame0, second.count) == (2, first.count, 4)

            await send(ws, m.Cancel(seq=9))  # nothing in flight: answered at once
            cancelled = await recv(ws)
            assert isinstance(cancelled, m.Cancelled) and (cancelled.seq, cancelled.chunk) == (9, 3)

            await send(ws, m.Fork(seq=10))
            forked = await recv(ws)
            assert isinstance(forked, m.Forked) and forked.seq == 10 and forked.session_id != ready.session_id

            await send(ws, m.Reset(seq=11, seed=2))
            again = await recv(ws)
            assert isinstance(again, m.Ready) and again.chunk == 2 and again.session_id == ready.session_id
            await send(ws, m.Step(seq=12, actions=[W]))
            third = await recv(ws)
            assert third.chunk == 3 and third.frame0 == first.count + 4  # numbering goes on

            await send(ws, m.Close())
            closed = await recv(ws)
            assert isinstance(closed, m.Closed) and closed.reason == "closed"
            await closed_with(ws, 1000)
            if isinstance(server, Server):  # a cluster front end holds no sessions to count
                assert len(server.manager) == 1  # only the fork is left, detached

    run(main())


def test_realtime_credits_pause_resume_and_actions(v1) -> None:
    async def main():
        async with v1() as server:
            ws = await dial(server)
            await send(ws, m.Open(seed=1, codec="jpeg", max_ahead=2))
            await recv(ws)
            await send(
                ws, m.Action(seq=3, keys=["w"], mouse=[1.0, 0.0], vector=np.zeros(2, np.float32), t=5.0)
            )
            got = [await recv(ws), await recv(ws)]
            assert [f.chunk for f in got] == [1, 2]
            assert all(isinstance(f.data, tuple) and f.data[0].startswith(b"\xff\xd8") for f in got)
            assert got[1].action_seq == 3
            await asyncio.sleep(0.3)
            await send(ws, m.Ping(t=1.0))  # no ack, no credit: the next message is the pong
            assert isinstance(await recv(ws), m.Pong)
            await send(ws, m.Pause(seq=4))
            await send(ws, m.Ack(chunk=2))
            await asyncio.sleep(0.3)
            await send(ws, m.Ping(t=2.0))
            assert isinstance(await recv(ws), m.Pong)  # paused: still nothing
            await send(ws, m.Resume(seq=5))
            third = await recv(ws)
            assert isinstance(third, m.Frames) and third.chunk == 3

    run(main())


def test_start_frame_travels_in_ready_and_each_step_gets_exactly_one_chunk(v1) -> None:
    async def main():
        async with v1() as server:
            ws = await dial(server)
            await send(ws, m.Open(model="tiny-image", seed=4, mode="lockstep", codec="raw"))
            ready = await recv(ws)
            assert isinstance(ready, m.Ready) and ready.chunk == 0
            start = ready.frame
            assert isinstance(start, np.ndarray) and start.shape == (32, 32, 3) and start.dtype == np.uint8
            await send(ws, m.Ping(t=1.0))
            assert isinstance(await recv(ws), m.Pong)  # nothing comes before the first step
            got = []
            for seq in (1, 2):  # a v1 client pairs each step with the next `frames`
                await send(ws, m.Step(seq=seq, actions=[W]))
                got.append(await recv(ws))
                assert isinstance(got[-1], m.Frames) and (got[-1].chunk, got[-1].action_seq) == (seq, seq)
                await send(ws, m.Ping(t=2.0))
                assert isinstance(await recv(ws), m.Pong)  # and nothing else came
            assert got[0].frame0 == 1 and got[1].frame0 == 1 + got[0].count  # the start image is frame 0
            await send(ws, m.Ack(chunk=2))
            await send(ws, m.Ping(t=3.0))
            assert isinstance(await recv(ws), m.Pong)  # the ack has been read

            ws.transport.abort()  # resumed: `ready` carries the latest committed frame
            ws = await dial(server, f"?resume={ready.resume_token}")
            again = await recv(ws)
            assert again.chunk == 2 and np.array_equal(again.frame, got[1].data[-1])

            await send(ws, m.Reset(seq=3, seed=9))  # reset: the new world's start frame
            reset = await recv(ws)
            assert isinstance(reset, m.Ready) and reset.chunk == 2 and not np.array_equal(reset.frame, start)
            fresh = await dial(server)
            await send(fresh, m.Open(model="tiny-image", seed=9, mode="lockstep", codec="raw"))
            assert np.array_equal((await recv(fresh)).frame, reset.frame)  # what seed 9 starts from

            for name in ("jpeg", "h264"):  # every other codec: one JPEG of the same picture
                other = await dial(server)
                await send(other, m.Open(model="tiny-image", seed=4, mode="lockstep", codec=name))
                jpeg = (await recv(other)).frame
                assert isinstance(jpeg, bytes) and psnr(decode_jpeg(jpeg), start) >= 35

            plain = await dial(server)  # a world that is not image-started has no frame yet
            await send(plain, m.Open(seed=4, mode="lockstep", codec="raw"))
            assert (await recv(plain)).frame is None

    run(main())


def test_the_default_world_starts_from_the_game_start_frame() -> None:
    from models import registry
    from models.tiny_world import start_image as game_start_image

    async def main():
        world = registry.from_name(registry.DEFAULT_MODEL)
        async with serving({world.spec.id: world}, default_model=world.spec.id) as server:
            frames = {}
            for name in ("raw", "jpeg"):
                ws = await dial(server)
                await send(ws, m.Open(seed=7, mode="lockstep", codec=name))
                frame = (await recv(ws)).frame
                frames[name] = frame if name == "raw" else decode_jpeg(frame)
        game = game_start_image(7, world.spec.width)
        assert psnr(frames["raw"], game) >= 33  # the start image, through the world's autoencoder
        assert psnr(frames["jpeg"], frames["raw"]) >= 35

    run(main())


def test_resume_after_a_dropped_socket_loses_and_repeats_nothing(v1) -> None:
    script = [[W], [D], [W], [D], [W]]

    async def main():
        async with v1() as server:
            async with connect(server.url, seed=3, mode="lockstep", codec="raw") as ref:
                reference = [await ref.step(a) for a in script]

            ws = await dial(server)
            await send(ws, m.Open(seed=3, mode="lockstep", codec="raw"))
            ready = await recv(ws)
            for seq, actions in enumerate(script[:3]):
                await send(ws, m.Step(seq=seq, actions=actions))
            first = await recv(ws)
            await send(ws, m.Ack(chunk=first.chunk))
            ws.transport.abort()  # the network goes away: no `close`, no closing handshake
            await asyncio.sleep(0.3)

            ws = await dial(server, f"?resume={ready.resume_token}")
            again = await recv(ws)
            assert isinstance(again, m.Ready) and again.session_id == ready.session_id
            seen = {first.chunk: first.data}
            for seq, actions in enumerate(script[3:], start=3):
                await send(ws, m.Step(seq=seq, actions=actions))
            while len(seen) < len(script):
                msg = await recv(ws)
                assert isinstance(msg, m.Frames), msg
                assert msg.chunk not in seen or np.array_equal(seen[msg.chunk], msg.data)  # resent: same
                seen[msg.chunk] = msg.data
            assert sorted(seen) == [1, 2, 3, 4, 5]
            for chunk, expected in enumerate(reference, start=1):
                assert np.array_equal(seen[chunk], expected)

    run(main())


def test_a_second_attach_evicts_the_first_socket(v1) -> None:
    async def main():
        async with v1() as server:
            ws = await dial(server)
            await send(ws, m.Open(seed=1, mode="lockstep"))
            ready = await recv(ws)
            other = await dial(server, f"?resume={ready.resume_token}&codec=raw")
            again = await recv(other)
            assert again.session_id == ready.session_id and again.codec.name == "raw"
            await closed_with(ws, 1000)
            await send(other, m.Step(seq=1, actions=[W]))
            assert isinstance(await recv(other), m.Frames)

    run(main())


def test_fork_over_the_wire_continues_both_worlds(v1) -> None:
    async def main():
        async with v1() as server, connect(server.url, seed=4, mode="lockstep", codec="raw") as s:
            await s.step([W])
            token = await s.fork()
            async with attach(server.url, token, codec="raw") as f:
                assert f.ready.chunk == 1 and f.ready.session_id != s.ready.session_id
                a, b = await s.step([D]), await f.step([D])
                assert np.array_equal(a, b)  # same committed world, same actions, same frames
                a, b = await s.step([W]), await f.step([D])
                assert not np.array_equal(a, b)

    run(main())


def test_oneshot_streams_frames_then_done_then_closes(v1) -> None:
    async def main():
        async with v1() as server:
            async with connect(server.url, seed=8, mode="lockstep", codec="raw") as ref:
                reference = np.concatenate([await ref.step(a) for a in [[W], [D], [{}]]])
            ws = await dial(server)
            await send(ws, m.Generate(seed=8, chunks=3, actions=[[W], [D]], codec="raw"))
            msgs = await recv_until(ws, m.Done)
            ready = msgs[0]  # an addition: a one-shot starts with `ready` too
            assert isinstance(ready, m.Ready) and ready.chunk == 0 and ready.resume_token == ""
            assert ready.frame is None and ready.model.id == "tiny" and ready.codec.name == "raw"
            frames = [msg for msg in msgs if isinstance(msg, m.Frames)]
            assert [f.chunk for f in frames] == [1, 2, 3] and len(msgs) == 5
            done = msgs[-1]
            assert done.chunks == 3 and done.frames == len(reference) and "denoise" in done.timings
            assert np.array_equal(np.concatenate([f.data for f in frames]), reference)
            closed = await recv(ws)
            assert isinstance(closed, m.Closed) and closed.reason == "done"
            await closed_with(ws, 1000)
            if isinstance(server, Server):  # a cluster front end holds no sessions to count
                assert len(server.manager) == 0

            ws = await dial(server)  # an image-started world: its start frame in `ready`, not a chunk
            await send(ws, m.Generate(model="tiny-image", seed=4, chunks=2, codec="raw"))
            msgs = await recv_until(ws, m.Done)
            opened = await dial(server)
            await send(opened, m.Open(model="tiny-image", seed=4, mode="lockstep", codec="raw"))
            assert np.array_equal(msgs[0].frame, (await recv(opened)).frame)
            frames = [msg for msg in msgs if isinstance(msg, m.Frames)]
            assert [(f.chunk, f.frame0) for f in frames] == [(1, 1), (2, 1 + frames[0].count)]
            assert msgs[-1].chunks == 2

    run(main())


def test_oneshot_actions_may_be_one_map_per_chunk_or_a_list_per_frame(v1) -> None:
    async def main():
        async with v1() as server:
            async with connect(server.url, seed=6, mode="lockstep", codec="raw") as ref:
                reference = np.concatenate([await ref.step(a) for a in [[W], [D] * 4, [{"keys": ["a"]}]]])
            ws = await dial(server)
            d = {
                "keys": ["d"],
                "mouse": [1.0, -2.0],
                "vector": codec.pack_array(np.array([0.5, -0.5], np.float32)),
            }
            actions = [
                {"keys": ["w"]},
                [d] * 4,
                {"keys": ["a"]},
            ]  # a map, a list, a map: as a v1 client sends
            await ws.send(
                msgpack.packb(
                    {"type": "generate", "seed": 6, "chunks": 3, "actions": actions, "codec": "raw"}
                )
            )
            msgs = await recv_until(ws, m.Done)
            frames = [msg.data for msg in msgs if isinstance(msg, m.Frames)]
            assert np.array_equal(np.concatenate(frames), reference)
            ws.transport.abort()

    run(main())


def test_a_oneshot_to_a_slow_reader_loses_no_frame(worlds) -> None:
    from web.metrics import DROPPED_FRAMES

    async def main():
        async with serving(worlds, outbox_chunks=2, send_buffer=8192) as server:
            before = DROPPED_FRAMES.labels("raw")._value.get()
            ws = await dial_stalled(server)
            await send(ws, m.Generate(seed=4, chunks=24, codec="raw"))
            await asyncio.sleep(2)  # not reading: a lossy outbox would have dropped chunks by now
            ws.transport.resume_reading()
            msgs = await recv_until(ws, m.Done)
            frames = [msg for msg in msgs if isinstance(msg, m.Frames)]
            assert [f.chunk for f in frames] == list(range(1, 25))
            assert msgs[-1].frames == sum(len(f.data) for f in frames)
            assert DROPPED_FRAMES.labels("raw")._value.get() == before
            ws.transport.abort()

    run(main())


def test_h264_frames_decode_close_to_the_raw_frames(worlds) -> None:
    script = [[W], [D], [W], [{"keys": ["a"]}], [D], [W]]

    async def main():
        async with (
            serving(worlds) as server,
            connect(server.url, model="smooth", seed=5, mode="lockstep", codec="raw") as raw,
            connect(server.url, model="smooth", seed=5, mode="lockstep", codec="h264") as h264,
        ):
            assert h264.ready.codec.codec == "avc1.42c00a" and h264.ready.codec.scale == 4  # 128x128 coded
            exact = np.concatenate([await raw.step(a) for a in script])
            decoded = np.concatenate([await h264.step(a) for a in script])
        assert decoded.shape == exact.shape == (23, 32, 32, 3)
        worst = min(psnr(a, b) for a, b in zip(exact, decoded, strict=True))
        assert worst >= 35, worst

    run(main())


def test_a_client_that_never_reads_does_not_stall_another(worlds) -> None:
    from web.metrics import DROPPED_FRAMES

    async def main():
        async with serving(worlds, outbox_chunks=2, send_buffer=8192) as server:
            before = DROPPED_FRAMES.labels("raw")._value.get()
            stalled = await dial_stalled(server)
            await send(stalled, m.Open(seed=1, codec="raw", max_ahead=64))
            async with connect(server.url, seed=2, codec="raw", max_ahead=4) as live:
                got = 0
                async for _ in live.chunks():
                    got += 1
                    if got == 40:
                        break
            for _ in range(600):  # the stalled session runs out of credits after 64 chunks
                if DROPPED_FRAMES.labels("raw")._value.get() > before:
                    break
                await asyncio.sleep(0.1)
            assert DROPPED_FRAMES.labels("raw")._value.get() > before
            stalled.transport.abort()

    run(main())


# -- who may connect ------------------------------------------------------------------------------


async def handshake_status(server, **kwargs) -> int:
    """101 when the websocket opened (then closed again), else the HTTP status it was refused with."""
    try:
        ws = await ws_connect(server.ws_url, proxy=None, compression=None, **kwargs)
    except InvalidStatus as exc:
        return exc.response.status_code
    await ws.close()
    return 101


def test_foreign_origins_are_refused(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
            here = f"http://127.0.0.1:{server.port}"
            assert await handshake_status(server) == 101  # not a browser
            assert await handshake_status(server, origin=here) == 101  # the page this server serves
            foreign_origins = (
                "http://evil.example",
                f"http://localhost:{server.port}",
                "null",
                f"https://127.0.0.1:{server.port}",  # same host and port, not the scheme served
            )
            for foreign in foreign_origins:
                assert await handshake_status(server, origin=foreign) == 403, foreign
        async with serving(worlds, allow_origins=("https://app.example",)) as server:
            assert await handshake_status(server, origin="https://app.example") == 101
            assert await handshake_status(server, origin="https://other.example") == 403
        async with serving(worlds, allow_origins=("*",)) as server:
            assert await handshake_status(server, origin="https://other.example") == 101

    run(main())


async def admitted_again(server) -> bool:
    """Whether a handshake is let in again within 5 s (a closed socket frees its slot once the
    server has seen the close)."""
    for _ in range(100):
        if await handshake_status(server) == 101:
            return True
        await asyncio.sleep(0.05)
    return False


def test_connections_past_the_cap_get_503(worlds) -> None:
    async def main():
        async with serving(worlds, max_connections=2, max_connections_per_address=0) as server:
            first, second = await dial(server), await dial(server)
            assert await handshake_status(server) == 503
            await send(second, m.Ping(t=1.0))
            assert isinstance(await recv(second), m.Pong)  # the admitted ones are served as usual
            await first.close()
            assert await admitted_again(server)  # the server sees the close a moment later

    run(main())


def test_one_address_cannot_take_every_connection(worlds) -> None:
    async def main():
        async with serving(worlds, max_connections=4, max_connections_per_address=2) as server:
            first, _ = await dial(server), await dial(server)
            assert await handshake_status(server) == 503  # a third from 127.0.0.1
            assert await handshake_status(server, local_addr=("127.0.0.2", 0)) == 101  # another client
            await first.close()
            assert await admitted_again(server)  # the server sees the close a moment later

    run(main())
    assert ServerConfig().per_address_cap == 16  # a quarter of the 64 connections
    assert ServerConfig(max_connections=2).per_address_cap == 1
    assert ServerConfig(max_connections_per_address=0).per_address_cap == 0  # no such cap


def test_listening_beyond_loopback_without_a_token_warns() -> None:
    assert exposure_warning(ServerConfig(host="127.0.0.1")) is None
    assert exposure_warning(ServerConfig(host="::1")) is None
    assert exposure_warning(ServerConfig(host="localhost")) is None
    assert exposure_warning(ServerConfig(host="0.0.0.0", token="s3cret")) is None
    for host in ("0.0.0.0", "", "192.168.1.5", "example.com"):
        assert "--token" in (exposure_warning(ServerConfig(host=host)) or ""), host


def test_stop_tells_sessions_and_one_shots_and_cuts_a_stalled_socket(worlds) -> None:
    async def until_closed(ws) -> list[m.ServerMessage]:
        got = []
        try:
            while True:
                got.append(await recv(ws, 30))
        except ConnectionClosed:
            return got

    async def main():
        server = Server(worlds, ServerConfig(port=0, default_model="tiny", outbox_chunks=2, send_buffer=8192))
        await server.start()
        try:
            stalled = await dial_stalled(server)  # never reads: its socket cannot drain
            await send(stalled, m.Open(seed=1, codec="raw", max_ahead=64))
            live = await dial(server)
            await send(live, m.Open(seed=2, mode="lockstep", codec="raw"))
            assert isinstance(await recv(live), m.Ready)
            oneshot = await dial(server)
            await send(oneshot, m.Generate(chunks=10_000, codec="jpeg"))
            assert isinstance((await recv_until(oneshot, m.Frames))[-1], m.Frames)  # it is running
            bare = await dial(server)  # nothing attached
            await send(bare, m.Ping(t=1.0))
            assert isinstance(await recv(bare), m.Pong)
        finally:
            await server.stop()  # returns although `stalled` never reads
        for ws in (live, oneshot):
            assert (await until_closed(ws))[-1] == m.Closed(reason="shutdown")
            assert ws.close_code == 1001
        assert await until_closed(bare) == [] and bare.close_code == 1001
        stalled.transport.abort()

    run(main())

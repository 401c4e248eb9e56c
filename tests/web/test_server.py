"""web/server.py end to end: a real server on loopback, raw protocol clients, every message type,
resume after a dropped socket, fork, one-shot, H.264 quality, a stalled client, and shutdown."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from web import messages as m
from web.sdk import attach, connect
from web.server import Server, ServerConfig

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


def test_lockstep_message_types(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
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
            assert len(server.manager) == 1  # only the fork is left, detached

    run(main())


def test_realtime_credits_pause_resume_and_actions(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
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


def test_image_started_world_sends_its_start_frame(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
            ws = await dial(server)
            await send(ws, m.Open(model="tiny-image", seed=4, mode="lockstep", codec="raw"))
            await recv(ws)
            start = await recv(ws)
            assert (
                isinstance(start, m.Frames)
                and start.chunk == 1
                and start.count == 1
                and start.action_seq is None
            )

    run(main())


def test_resume_after_a_dropped_socket_loses_and_repeats_nothing(worlds) -> None:
    script = [[W], [D], [W], [D], [W]]

    async def main():
        async with serving(worlds) as server:
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


def test_a_second_attach_evicts_the_first_socket(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
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


def test_fork_over_the_wire_continues_both_worlds(worlds) -> None:
    async def main():
        async with serving(worlds) as server, connect(server.url, seed=4, mode="lockstep", codec="raw") as s:
            await s.step([W])
            token = await s.fork()
            async with attach(server.url, token, codec="raw") as f:
                assert f.ready.chunk == 1 and f.ready.session_id != s.ready.session_id
                a, b = await s.step([D]), await f.step([D])
                assert np.array_equal(a, b)  # same committed world, same actions, same frames
                a, b = await s.step([W]), await f.step([D])
                assert not np.array_equal(a, b)

    run(main())


def test_oneshot_streams_frames_then_done_then_closes(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
            async with connect(server.url, seed=8, mode="lockstep", codec="raw") as ref:
                reference = np.concatenate([await ref.step(a) for a in [[W], [D], [{}]]])
            ws = await dial(server)
            await send(ws, m.Generate(seed=8, chunks=3, actions=[[W], [D]], codec="raw"))
            msgs = await recv_until(ws, m.Done)
            frames = [msg for msg in msgs if isinstance(msg, m.Frames)]
            assert [f.chunk for f in frames] == [1, 2, 3] and len(msgs) == 4
            done = msgs[-1]
            assert done.chunks == 3 and done.frames == len(reference) and "denoise" in done.timings
            assert np.array_equal(np.concatenate([f.data for f in frames]), reference)
            closed = await recv(ws)
            assert isinstance(closed, m.Closed) and closed.reason == "done"
            await closed_with(ws, 1000)
            assert len(server.manager) == 0

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

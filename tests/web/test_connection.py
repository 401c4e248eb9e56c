"""web/connection.py over a real socket: every protocol error code, fatal and not, the token, the
debug hooks, and a fuzz of random bytes and maps that must never take the server down."""

from __future__ import annotations

import asyncio
import contextlib

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as sync_connect

from web import codec
from web import messages as m
from web.errors import ErrorCode

from .conftest import dial, recv, recv_until, run, send, serving, serving_in_thread

W = m.FrameAction(keys=("w",))


async def expect_error(ws, code: ErrorCode, *, fatal: bool = False, seq: int | None = None) -> m.Error:
    msg = await recv(ws)
    assert isinstance(msg, m.Error), msg
    assert (msg.code, msg.fatal) == (code, fatal), msg
    if seq is not None:
        assert msg.seq == seq
    return msg


async def expect_close(ws, code: int) -> None:
    """The server closes with `code`, after at most a `closed`."""
    try:
        while True:
            msg = await recv(ws, 30)
            assert isinstance(msg, m.Closed), msg
    except ConnectionClosed:
        pass
    assert ws.close_code == code, (ws.close_code, ws.close_reason)


async def opened(server, **fields) -> tuple:
    ws = await dial(server)
    await send(ws, m.Open(**{"seed": 1, "mode": "lockstep", "codec": "raw", **fields}))
    ready = await recv(ws)
    assert isinstance(ready, m.Ready), ready
    return ws, ready


async def still_steps(ws, seq: int = 100) -> None:
    """The session works exactly as before the error."""
    await send(ws, m.Step(seq=seq, actions=[W]))
    msg = await recv(ws)
    assert isinstance(msg, m.Frames) and msg.action_seq == seq, msg


def test_malformed_messages_are_not_fatal(v1) -> None:
    async def main():
        async with v1() as server:
            ws, _ = await opened(server)
            await ws.send("a text frame")
            await expect_error(ws, ErrorCode.BAD_MESSAGE)
            await ws.send(b"\xc1")  # never valid msgpack
            await expect_error(ws, ErrorCode.BAD_MESSAGE)
            await ws.send(msgpack.packb([1, 2]))  # not a map
            await expect_error(ws, ErrorCode.BAD_MESSAGE)
            await ws.send(msgpack.packb({"type": "teleport", "seq": 4}))
            await expect_error(ws, ErrorCode.UNKNOWN_TYPE, seq=4)
            await ws.send(msgpack.packb({"type": "step", "seq": 5, "actions": [{"mouse": [1, "x"]}]}))
            err = await expect_error(ws, ErrorCode.INVALID_FIELD, seq=5)
            assert err.message.startswith("actions.0.mouse.1: ")
            await still_steps(ws)

    run(main())


def test_session_level_invalid_fields_name_the_field(v1) -> None:
    async def main():
        async with v1() as server:
            ws, _ = await opened(server)
            await send(ws, m.Step(seq=1, actions=[m.FrameAction(keys=("jump",))]))
            assert (await expect_error(ws, ErrorCode.INVALID_FIELD, seq=1)).message.startswith("keys: ")
            await send(ws, m.Step(seq=2, actions=[W, W]))  # the first chunk takes 1 or 3 actions
            assert (await expect_error(ws, ErrorCode.INVALID_FIELD, seq=2)).message.startswith("actions: ")
            await send(ws, m.Action(seq=3, keys=["w"]))  # realtime input on a lockstep session
            assert (await expect_error(ws, ErrorCode.INVALID_FIELD, seq=3)).message.startswith("type: ")
            await send(ws, m.Ack(chunk=9))
            assert (await expect_error(ws, ErrorCode.INVALID_FIELD)).message.startswith("chunk: ")
            await send(ws, m.Reset(seq=4, prompt="a castle"))
            assert (await expect_error(ws, ErrorCode.INVALID_FIELD, seq=4)).message.startswith("prompt: ")
            await send(ws, m.Open())
            await expect_error(ws, ErrorCode.INVALID_FIELD)
            await still_steps(ws)

    run(main())


def test_messages_before_open(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
            ws = await dial(server)
            await send(ws, m.Step(seq=1, actions=[W]))
            err = await expect_error(ws, ErrorCode.INVALID_FIELD, seq=1)
            assert err.message.startswith("type: ")
            await send(ws, m.Open(debug=m.DebugHooks(step_delay_ms=1)))  # hooks are off
            assert (await expect_error(ws, ErrorCode.INVALID_FIELD)).message.startswith("debug: ")
            await send(ws, m.Open(mode="lockstep"))
            assert isinstance(await recv(ws), m.Ready)

    run(main())


def test_too_large_is_fatal_with_1009(worlds) -> None:
    async def main():
        async with serving(worlds, max_message=4096) as server:
            ws, _ = await opened(server)
            await ws.send(msgpack.packb({"type": "ping", "t": 1.0, "pad": b"x" * 5000}))
            await expect_error(ws, ErrorCode.TOO_LARGE, fatal=True)
            await expect_close(ws, 1009)
            assert len(server.manager) == 0  # a fatal error ends the session

    run(main())


def test_rate_limits(worlds) -> None:
    async def main():
        # rate 1/s: the bucket barely refills while the test runs, however slow the machine is
        async with serving(worlds, debug_hooks=True, rate=1, burst=40) as server:
            ws, _ = await opened(server, debug=m.DebugHooks(step_delay_ms=50))
            for seq in range(9):  # 8 steps may be outstanding
                await send(ws, m.Step(seq=seq, actions=[W]))
            await expect_error(ws, ErrorCode.RATE_LIMITED, seq=8)
            for _ in range(60):  # past the burst
                await send(ws, m.Ping(t=0.0))
            kinds: list[str] = []
            while kinds.count("Frames") < 8:
                kinds.append(type(await recv(ws)).__name__)
            assert "Error" in kinds  # excess pings were dropped with rate_limited

    run(main())


def test_busy_when_full(worlds) -> None:
    async def main():
        async with serving(worlds, max_sessions=1) as server:
            first, _ = await opened(server)
            ws = await dial(server)
            await send(ws, m.Open())
            await expect_error(ws, ErrorCode.BUSY, fatal=True)
            await expect_close(ws, 1013)
            await still_steps(first)

    run(main())


def test_not_found(v1) -> None:
    async def main():
        async with v1() as server:
            ws = await dial(server)
            await send(ws, m.Open(model="nope"))
            await expect_error(ws, ErrorCode.NOT_FOUND, fatal=True)
            await expect_close(ws, 1008)
            ws = await dial(server, "?resume=not-a-token")
            await expect_error(ws, ErrorCode.NOT_FOUND, fatal=True)
            await expect_close(ws, 1008)
            ws = await dial(server)
            await send(ws, m.Generate(model="nope", chunks=1))
            await expect_error(ws, ErrorCode.NOT_FOUND, fatal=True)
            await expect_close(ws, 1008)

    run(main())


def test_closed_sessions_tokens_are_dead(v1) -> None:
    async def main():
        async with v1() as server:
            ws, ready = await opened(server)
            await send(ws, m.Close())
            await expect_close(ws, 1000)
            ws = await dial(server, f"?resume={ready.resume_token}")
            await expect_error(ws, ErrorCode.NOT_FOUND, fatal=True)

    run(main())


def test_token_is_enforced(worlds) -> None:
    async def main():
        async with serving(worlds, token="s3cret") as server:
            for msg in (m.Open(), m.Open(token="wrong"), m.Generate(chunks=1)):
                ws = await dial(server)
                await send(ws, msg)
                await expect_error(ws, ErrorCode.UNAUTHORIZED, fatal=True)
                await expect_close(ws, 1008)
            ws, _ = await opened(server, token="s3cret")
            await still_steps(ws)
            ws = await dial(server)
            await send(ws, m.Generate(chunks=1, token="s3cret"))
            assert isinstance(await recv(ws), m.Ready)  # a one-shot starts with `ready`
            assert isinstance(await recv(ws), m.Frames)

    run(main())


def test_internal_error_from_a_failing_chunk_leaves_the_session_usable(v1) -> None:
    async def main():
        async with v1(debug_hooks=True) as server:
            ws, _ = await opened(server, debug=m.DebugHooks(fail_at_chunk=2))
            await still_steps(ws, 1)
            await send(ws, m.Step(seq=2, actions=[W] * 4))
            err = await expect_error(ws, ErrorCode.INTERNAL, seq=2)
            assert "rolled back" in err.message
            await send(ws, m.Step(seq=3, actions=[W] * 4))  # the fault fires once
            msg = await recv(ws)
            assert isinstance(msg, m.Frames) and msg.chunk == 2

    run(main())


def test_an_error_ends_a_oneshot(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
            ws = await dial(server)
            await send(ws, m.Generate(chunks=3, actions=[[W], [W, W]]))  # chunk 2 takes 1 or 4 actions
            msgs = [msg for msg in await recv_until(ws, m.Closed) if not isinstance(msg, m.Frames)]
            assert [type(msg) for msg in msgs] == [m.Ready, m.Error, m.Closed]
            assert msgs[1].code is ErrorCode.INVALID_FIELD and msgs[1].fatal and msgs[1].seq == 1
            assert msgs[1].message.startswith("actions: ") and msgs[2].reason == "error"
            await expect_close(ws, 1008)

            ws = await dial(server)  # a fatal protocol error during a one-shot ends it too
            await send(ws, m.Generate(chunks=50))
            assert isinstance(await recv(ws), m.Ready)
            assert isinstance(await recv(ws), m.Frames)
            await ws.send(b"\x00" * (server.config.max_message + 1))
            msgs = []
            try:
                while True:
                    msgs.append(await recv(ws))
            except ConnectionClosed:
                pass
            errors = [x for x in msgs if isinstance(x, m.Error)]
            assert errors and errors[0].code is ErrorCode.TOO_LARGE and ws.close_code == 1009
            assert not any(isinstance(x, m.Done) for x in msgs)
            for _ in range(100):
                if len(server.manager) == 0:
                    break
                await asyncio.sleep(0.05)
            assert len(server.manager) == 0

    run(main())


def test_a_realtime_session_detaches_when_its_socket_drops(worlds) -> None:
    async def main():
        async with serving(worlds) as server:
            ws, ready = await opened(server, mode="realtime")
            ws.transport.abort()
            for _ in range(100):
                session = server.manager.by_token(ready.resume_token)
                if session.status.name == "DETACHED":
                    break
                await asyncio.sleep(0.05)
            assert session.status.name == "DETACHED"
            ws = await dial(server, f"?resume={ready.resume_token}")
            again = await recv(ws)
            assert isinstance(again, m.Ready) and again.session_id == ready.session_id
            frames = await recv(ws)
            assert isinstance(frames, m.Frames)

    run(main())


# -- abuse --------------------------------------------------------------------------------------


async def ping_answered(ws) -> list[m.ServerMessage]:
    """Ping until a pong comes back (a ping may be dropped while the rate limit refills);
    returns the other messages read meanwhile."""
    before: list[m.ServerMessage] = []
    for t in range(60):
        await send(ws, m.Ping(t=-1.0 - t))
        with contextlib.suppress(TimeoutError):
            while True:
                msg = await recv(ws, 1.0)
                if isinstance(msg, m.Pong) and msg.t < 0:
                    return before
                before.append(msg)
    raise AssertionError("no pong")


def test_costly_messages_are_refused_early_and_leave_others_alone(v1) -> None:
    async def main():
        async with v1() as server:
            other, _ = await opened(server)
            ws = await dial(server)
            nested = msgpack.packb({"type": "ping", "t": 1.0, "x": [[[]] * 10_000] * 100})  # 1 MB
            await ws.send(nested)
            await expect_error(ws, ErrorCode.BAD_MESSAGE)
            script = msgpack.packb({"type": "generate", "chunks": 8000, "actions": [[{}] * 7] * 8000})
            await ws.send(script)  # 64 KB, 64k maps and arrays
            await expect_error(ws, ErrorCode.BAD_MESSAGE)
            assert await ping_answered(other) == []
            await still_steps(other)
            # non-fatal: the connection goes on (after a rate_limited or two: they cost tokens)
            assert all(x.code is ErrorCode.RATE_LIMITED for x in await ping_answered(ws))

    run(main())


def test_a_burst_while_reading_is_rate_limited_not_closed(v1) -> None:
    async def main():
        async with v1() as server:
            ws = await dial(server)
            got: list[m.ServerMessage] = []

            async def read() -> None:
                while True:
                    got.append(await recv(ws))

            reader = asyncio.create_task(read())
            ping = codec.encode(m.Ping(t=0.0))
            for _ in range(2500):  # past the burst of 1000
                await ws.send(ping)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            got += await ping_answered(ws)
            errors = [x for x in got if isinstance(x, m.Error)]
            assert errors and all(e.code is ErrorCode.RATE_LIMITED and not e.fatal for e in errors)
            pongs = sum(isinstance(x, m.Pong) for x in got)
            assert len(errors) < 2500 - pongs  # the refusals' replies are limited too
            assert ws.close_code is None

    run(main())


def test_fragmented_messages_are_reassembled_or_too_large(v1) -> None:
    async def main():
        async with v1() as server:
            ws = await dial(server)
            data = msgpack.packb({"type": "ping", "t": 3.0, "pad": b"x" * 1000})
            await ws.send([data[i : i + 10] for i in range(0, len(data), 10)])  # 101 fragments
            err = await expect_error(ws, ErrorCode.INVALID_FIELD)  # reassembled and parsed
            assert err.message.startswith("pad: ")
            data = msgpack.packb({"type": "ping", "t": 4.0, "pad": b"x" * 200_000})
            await ws.send([data[i : i + 40] for i in range(0, len(data), 40)])  # 5001 fragments
            await expect_error(ws, ErrorCode.TOO_LARGE, fatal=True)
            await expect_close(ws, 1009)

    run(main())


def test_forks_and_live_sessions_per_connection_are_capped(worlds) -> None:
    async def main():
        async with serving(worlds, sessions_per_connection=3, forks_per_connection=3) as server:
            ws, _ = await opened(server)
            tokens = []
            for seq in (1, 2):
                await send(ws, m.Fork(seq=seq))
                forked = await recv(ws)
                assert isinstance(forked, m.Forked), forked
                tokens.append(forked.resume_token)
            await send(ws, m.Fork(seq=3))  # its own session + 2 forks live
            assert "live sessions" in (await expect_error(ws, ErrorCode.BUSY, seq=3)).message
            other = await dial(server, f"?resume={tokens[0]}")
            assert isinstance(await recv(other), m.Ready)
            await send(other, m.Close())
            await expect_close(other, 1000)
            await send(ws, m.Fork(seq=4))  # room again
            assert isinstance(await recv(ws), m.Forked)
            other = await dial(server, f"?resume={tokens[1]}")
            assert isinstance(await recv(other), m.Ready)
            await send(other, m.Close())
            await expect_close(other, 1000)
            await send(ws, m.Fork(seq=5))  # 2 live, but 3 forks made already
            assert "forks per connection" in (await expect_error(ws, ErrorCode.BUSY, seq=5)).message
            await still_steps(ws)
            assert len(server.manager) == 2

    run(main())


def test_idle_sessions_and_connections_are_closed(worlds) -> None:
    async def main():
        async with serving(worlds, idle_timeout_s=0.5) as server:
            ws, _ = await opened(server)
            await still_steps(ws)
            closed = await recv(ws)  # nothing more from the client
            assert isinstance(closed, m.Closed) and closed.reason == "idle"
            await expect_close(ws, 1000)
            assert len(server.manager) == 0
            bare = await dial(server)
            await expect_close(bare, 1000)  # no session: just the close

    run(main())


def test_a_connection_that_never_opens_does_not_hold_a_slot(worlds) -> None:
    async def main():
        async with serving(worlds, idle_timeout_s=600, open_timeout_s=0.3, max_connections=1) as server:
            bare = await dial(server)  # never sends `open`
            await expect_close(bare, 1000)  # long before the 600 s idle timeout
            ws, _ = await opened(server)  # the slot is free again, and a session gets the long timeout
            await asyncio.sleep(0.6)
            await still_steps(ws)

    run(main())


def test_pings_do_not_extend_the_open_timeout(worlds) -> None:
    """A client that pings but never opens loses its slot at the open timeout (it used to restart
    on every message, so pinging sockets held the connection cap forever)."""

    async def main():
        async with serving(worlds, idle_timeout_s=600, open_timeout_s=2.0) as server:
            ws = await dial(server)
            pongs = 0
            with contextlib.suppress(ConnectionClosed):
                while pongs < 400:  # 20 s of pings, 20 a second: the timer restarted on each
                    await send(ws, m.Ping(t=0.0))
                    assert isinstance(await recv(ws), m.Pong)
                    pongs += 1
                    await asyncio.sleep(0.05)
            assert pongs < 400, "still open after 20 s of pings"
            assert (ws.close_code, ws.close_reason) == (1000, "idle")

    run(main())


def test_a_step_in_flight_is_not_idle(worlds) -> None:
    """A lockstep step that takes longer than the idle timeout is answered; the session is closed
    as idle only after it (it used to be closed while the step ran)."""

    async def main():
        async with serving(worlds, debug_hooks=True, idle_timeout_s=0.3) as server:
            ws, _ = await opened(server, debug=m.DebugHooks(step_delay_ms=1500))
            await send(ws, m.Step(seq=1, actions=[W]))
            frames = await recv(ws)
            assert isinstance(frames, m.Frames) and frames.action_seq == 1, frames
            closed = await recv(ws)  # then nothing from the client: idle
            assert isinstance(closed, m.Closed) and closed.reason == "idle", closed
            await expect_close(ws, 1000)

    run(main())


def test_a_dropped_session_gives_way_to_a_new_client(worlds) -> None:
    async def main():
        async with serving(worlds, max_sessions=1) as server:
            first, ready = await opened(server)
            first.transport.abort()
            for _ in range(100):
                if server.manager.by_token(ready.resume_token).status.name == "DETACHED":
                    break
                await asyncio.sleep(0.05)
            ws, _ = await opened(server)  # the detached session is evicted, not the newcomer
            await still_steps(ws)
            again = await dial(server, f"?resume={ready.resume_token}")
            await expect_error(again, ErrorCode.NOT_FOUND, fatal=True)

    run(main())


# -- fuzz -----------------------------------------------------------------------------------------

MESSAGE_TYPES = sorted(m.CLIENT_TYPES - {"open", "generate", "ping"})  # these three have replies
scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
values = st.recursive(
    scalars | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
maps = st.dictionaries(
    st.sampled_from(["seq", "keys", "mouse", "actions", "chunk", "vector", "t", "x"]) | st.text(max_size=6),
    values,
    max_size=5,
).flatmap(lambda d: st.sampled_from([*MESSAGE_TYPES, "", "teleport", None]).map(lambda t: {**d, "type": t}))


class Fuzzer:
    """A sync client that reconnects whenever the server closed the last socket."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws = None

    def answer(self, data: bytes) -> m.ServerMessage | None:
        """What the server says to `data`: a message, or None when it closed the socket."""
        if self.ws is None:
            self.ws = sync_connect(self.url, proxy=None, compression=None, legacy=True)
        try:
            self.ws.send(data)
            return codec.parse_server(self.ws.recv(timeout=30))
        except ConnectionClosed:
            self.ws = None
            return None


def test_fuzz_never_crashes_the_server(worlds) -> None:
    with serving_in_thread(worlds) as server:
        fuzzer = Fuzzer(server.ws_url)

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.binary(max_size=200) | maps.map(lambda d: msgpack.packb(d, use_bin_type=True)))
        def fuzz(data: bytes) -> None:
            answer = fuzzer.answer(data)
            assert answer is None or isinstance(answer, m.Error), answer

        fuzz()
        with sync_connect(server.ws_url, proxy=None) as ws:  # a fresh client is served as usual
            ws.send(codec.encode(m.Open(mode="lockstep")))
            assert isinstance(codec.parse_server(ws.recv(timeout=30)), m.Ready)
            ws.send(codec.encode(m.Step(seq=1, actions=[W])))
            assert isinstance(codec.parse_server(ws.recv(timeout=60)), m.Frames)


def test_fuzz_a_live_session_with_bytes(worlds) -> None:
    with serving_in_thread(worlds) as server, sync_connect(server.ws_url, proxy=None) as ws:
        ws.send(codec.encode(m.Open(mode="lockstep", codec="raw")))
        assert isinstance(codec.parse_server(ws.recv(timeout=30)), m.Ready)

        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.binary(min_size=1, max_size=300))
        def fuzz(data: bytes) -> None:
            ws.send(data)
            answer = codec.parse_server(ws.recv(timeout=30))
            assert isinstance(answer, m.Error) and not answer.fatal, answer

        fuzz()
        ws.send(codec.encode(m.Step(seq=1, actions=[m.FrameAction(vector=np.zeros(2, np.float32))])))
        assert isinstance(codec.parse_server(ws.recv(timeout=60)), m.Frames)

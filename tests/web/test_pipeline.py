"""web/pipeline.py: ordered delivery into the outbox, encoding off the loop, keyframe after a drop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sessions.events import CancelledEvent, ClosedEvent, ErrorEvent, FramesEvent, ReadyEvent
from web import codec
from web import messages as m
from web.encoders import ChunkDecoder, H264Encoder, JpegEncoder, RawEncoder, decode_jpeg
from web.outbox import Outbox, OutboxOverflow
from web.pipeline import CloseRequest, Pipeline, close_code_for

from .conftest import run


def chunk(n: int, count: int = 4) -> FramesEvent:
    rng = np.random.default_rng(n)
    base = rng.integers(0, 256, (1, 1, 1, 3), dtype=np.uint8)  # a flat colour per chunk
    frames = np.broadcast_to(base, (count, 32, 32, 3)).copy()
    return FramesEvent(chunk=n, frame0=4 * (n - 1), frames=frames, action_seq=n - 2, timings={"total": 1.0})


def ready(codec_name: m.Codec = "jpeg") -> m.Ready:
    """A session's `ready`, as the connection attaches it."""
    model = m.ModelInfo(
        id="x", fps=15, chunk_frames=4, width=32, height=32, action_space={"keys": [], "mouse": False}
    )
    return m.Ready(session_id="s", resume_token="t", model=model, codec=m.CodecInfo(name=codec_name))


async def settle(pipe: Pipeline) -> None:
    while not pipe._queue.empty():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the last encode


def drain(box: Outbox) -> list[m.ServerMessage | tuple[int, str]]:
    out = []
    while (item := box.pop()) is not None:
        out.append(item.close if item.close else codec.parse_server(item.data))
    return out


def test_events_and_replies_keep_their_order() -> None:
    async def main():
        with ThreadPoolExecutor(1) as pool:
            box = Outbox()
            pipe = Pipeline(box, pool)
            pipe.attach(JpegEncoder(), ready())
            task = asyncio.create_task(pipe.run())
            pipe.put(chunk(1))
            pipe.put(m.Pong(t=1.0, server_t=2.0))
            pipe.put(CancelledEvent(seq=3, chunk=2))
            pipe.put(ReadyEvent(chunk=1))
            pipe.put(ErrorEvent("invalid_field", "keys: nope", seq=4))
            pipe.put(ClosedEvent("closed"))
            await settle(pipe)
            task.cancel()
            out = drain(box)
        assert [type(x).__name__ for x in out] == [
            "Frames",
            "Pong",
            "Cancelled",
            "Ready",
            "Error",
            "Closed",
            "tuple",
        ]
        frames = out[0]
        assert frames.action_seq is None and frames.chunk == 1 and "encode" in frames.timings
        assert out[3].chunk == 1 and out[3].session_id == "s"
        assert out[-1] == (1000, "closed")

    run(main())


def test_ready_events_carry_the_frame_in_the_session_codec() -> None:
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)

    async def main(encoder) -> list[m.ServerMessage]:
        with ThreadPoolExecutor(1) as pool:
            box = Outbox()
            pipe = Pipeline(box, pool)
            pipe.attach(encoder, ready(encoder.codec))
            task = asyncio.create_task(pipe.run())
            pipe.put(ReadyEvent(chunk=0, frame=image))
            pipe.put(chunk(1))
            pipe.put(ReadyEvent(chunk=1))  # a reset of a world with no start frame
            await settle(pipe)
            task.cancel()
            return drain(box)

    first, frames, again = run(main(RawEncoder()))
    assert isinstance(first, m.Ready) and first.chunk == 0 and np.array_equal(first.frame, image)
    assert isinstance(frames, m.Frames) and isinstance(again, m.Ready)
    assert (again.chunk, again.frame, again.session_id) == (1, None, "s")
    first, *_ = run(main(JpegEncoder()))
    assert isinstance(first.frame, bytes) and decode_jpeg(first.frame).shape == (32, 32, 3)


def test_a_fatal_error_sets_the_close_code() -> None:
    async def main():
        with ThreadPoolExecutor(1) as pool:
            box = Outbox()
            pipe = Pipeline(box, pool)
            task = asyncio.create_task(pipe.run())
            pipe.put(m.Error(code="too_large", message="big", fatal=True))
            pipe.put(CloseRequest(1000, "too_large"))
            await settle(pipe)
            task.cancel()
            assert drain(box)[-1] == (1009, "too_large")

    run(main())
    assert (close_code_for("error"), close_code_for("shutdown"), close_code_for("done")) == (1011, 1001, 1000)


def test_h264_drop_is_followed_by_a_keyframe_the_client_can_start_from() -> None:
    async def main():
        with ThreadPoolExecutor(1) as pool:
            box = Outbox(max_chunks=2)  # nobody pops: a client that stopped reading
            pipe = Pipeline(box, pool)
            pipe.attach(H264Encoder(32, 32, 15), ready("h264"))
            task = asyncio.create_task(pipe.run())
            for n in (1, 2, 3):  # 1 and 2 fill the queue; 3 (a P-frame) overflows it: all go
                pipe.put(chunk(n))
            await settle(pipe)
            assert len(box) == 0 and box.dropped == 12
            for n in (4, 5):
                pipe.put(chunk(n))
            await settle(pipe)
            task.cancel()
            out = drain(box)
        assert [(f.chunk, f.key) for f in out] == [(4, True), (5, False)]
        decoder = ChunkDecoder("h264")  # a client that lost 1..3 decodes from 4 on
        assert [decoder.decode(f).shape for f in out] == [(4, 32, 32, 3)] * 2

    run(main())


def test_room_waits_until_the_outbox_has_space() -> None:
    async def main():
        with ThreadPoolExecutor(1) as pool:
            box = Outbox(max_chunks=2)
            pipe = Pipeline(box, pool)
            pipe.attach(JpegEncoder(), ready(), lossless=True)
            task = asyncio.create_task(pipe.run())
            await asyncio.wait_for(pipe.room(), 1)  # empty: room at once
            pipe.put(chunk(1))
            pipe.put(chunk(2))
            waiter = asyncio.create_task(pipe.room())
            await settle(pipe)
            assert box.chunks == 2 and not waiter.done()  # both encoded, none sent: no room
            assert box.pop() is not None  # the writer sends one
            await asyncio.wait_for(waiter, 1)
            task.cancel()

    run(main())


def test_a_full_queue_ends_the_pipeline_with_overflow() -> None:
    async def main():
        with ThreadPoolExecutor(1) as pool:
            pipe = Pipeline(Outbox(), pool, max_items=3)
            for t in range(5):  # nothing runs yet: the last two do not fit
                pipe.put(m.Pong(t=t, server_t=0))
            assert pipe._queue.qsize() == 3
            with pytest.raises(OutboxOverflow):
                await asyncio.wait_for(pipe.run(), 1)

    run(main())

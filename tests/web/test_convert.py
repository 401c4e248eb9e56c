"""web/convert.py: wire messages <-> session types, no I/O."""

from __future__ import annotations

import numpy as np

from models.actions import ActionSpace
from models.world import ModelSpec
from runtime.requests import DebugHooks
from sessions.errors import InvalidInput, SessionBusy, SessionFailed
from sessions.events import FramesEvent
from web import convert
from web import messages as m
from web.encoders import EncodedChunk, decode_jpeg
from web.errors import ErrorCode

from .conftest import psnr


def test_open_and_generate_params() -> None:
    image = np.zeros((4, 4, 3), np.uint8)
    msg = m.Open(
        model="x", seed=3, image=image, mode="lockstep", max_ahead=5, debug=m.DebugHooks(fail_at_chunk=2)
    )
    p = convert.open_params(msg)
    assert (p.model, p.seed, p.mode, p.max_ahead) == ("x", 3, "lockstep", 5) and p.image is image
    assert p.debug == DebugHooks(step_delay_ms=0.0, fail_at_chunk=2)
    g = convert.open_params(m.Generate(seed=1, chunks=2))
    assert g.mode == "lockstep" and g.debug is None and g.seed == 1


def test_frame_actions() -> None:
    (a,) = convert.frame_actions(
        [m.FrameAction(keys=("w", "d"), mouse=(1, 2), vector=np.ones(2, np.float32))]
    )
    assert a.keys == frozenset({"w", "d"}) and a.mouse == (1.0, 2.0) and a.vector == (1.0, 1.0)
    assert convert.frame_actions([m.FrameAction()])[0].vector is None


def test_model_info_and_frames() -> None:
    spec = ModelSpec("w", 15.0, 64, 32, 4, ActionSpace(("a",), True, 2), image_start=False)
    info = convert.model_info(spec)
    assert (info.width, info.height, info.chunk_frames, info.action_space.vector_dim) == (64, 32, 4, 2)
    frames = np.zeros((2, 32, 64, 3), np.uint8)
    event = FramesEvent(chunk=3, frame0=9, frames=frames, action_seq=-1, timings={"total": 5.0})
    msg = convert.frames(event, "raw", EncodedChunk(frames, True), 0.1234)
    assert (msg.chunk, msg.frame0, msg.count, msg.action_seq) == (3, 9, 2, None)
    assert msg.timings == {"total": 5.0, "encode": 0.123}


def test_ready_frame_is_the_array_for_raw_and_one_jpeg_otherwise() -> None:
    y, x = np.mgrid[0:32, 0:48]
    image = np.stack([x * 5, y * 7, (x + y) * 3], axis=-1).astype(np.uint8)  # smooth: JPEG keeps it
    assert convert.ready_frame("raw", image) is image
    for name in ("jpeg", "h264"):
        jpeg = convert.ready_frame(name, image)
        assert isinstance(jpeg, bytes) and jpeg.startswith(b"\xff\xd8")
        assert psnr(decode_jpeg(jpeg), image) > 30
    spec = ModelSpec("w", 15.0, 48, 32, 4, ActionSpace(("a",), True, 0), image_start=True)
    ready = convert.oneshot_ready(spec, m.CodecInfo(name="jpeg"))
    assert ready.resume_token == "" and ready.session_id and ready.chunk == 0 and ready.frame is None


def test_session_errors_become_protocol_errors() -> None:
    err = convert.protocol_error(InvalidInput("unknown keys ['x']", field="keys"), 7)
    assert (err.code, err.message, err.seq, err.fatal, err.field) == (
        ErrorCode.INVALID_FIELD,
        "keys: unknown keys ['x']",
        7,
        False,
        "keys",
    )
    assert convert.protocol_error(InvalidInput("keys: already named", field="keys"), None).message == (
        "keys: already named"
    )
    assert convert.protocol_error(SessionBusy("full"), None).code is ErrorCode.BUSY
    assert convert.protocol_error(SessionFailed("dead"), None).fatal
    assert convert.protocol_error(SessionBusy("full"), None, fatal=True).fatal

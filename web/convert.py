"""Pure conversions between protocol messages (web.messages) and the session layer's plain types.

The server's only translation table: wire messages in -> session parameters and actions; session
events and specs -> wire messages out. No I/O, no event loop.
"""

import uuid
from collections.abc import Sequence

import numpy as np

from models.actions import FrameAction
from models.world import ModelSpec
from runtime.requests import DebugHooks
from sessions.errors import SessionError
from sessions.events import CancelledEvent, DoneEvent, ErrorEvent, FramesEvent
from sessions.manager import OpenParams
from sessions.session import Session
from web import messages as m
from web.encoders import EncodedChunk, encode_still
from web.errors import ErrorCode, ProtocolError

__all__ = [
    "cancelled",
    "done",
    "error_event",
    "frame_actions",
    "frames",
    "model_info",
    "oneshot_ready",
    "open_params",
    "protocol_error",
    "ready",
    "ready_frame",
]


def open_params(msg: m.Open | m.Generate) -> OpenParams:
    """Session parameters for an ``open`` (or the session a ``generate`` runs in)."""
    if isinstance(msg, m.Generate):
        return OpenParams(model=msg.model, seed=msg.seed, prompt=msg.prompt, mode="lockstep")
    debug = None
    if msg.debug is not None:
        debug = DebugHooks(step_delay_ms=msg.debug.step_delay_ms, fail_at_chunk=msg.debug.fail_at_chunk)
    return OpenParams(
        model=msg.model,
        seed=msg.seed,
        prompt=msg.prompt,
        image=msg.image,
        mode=msg.mode,
        max_ahead=msg.max_ahead,
        debug=debug,
    )


def frame_actions(actions: Sequence[m.FrameAction]) -> list[FrameAction]:
    """The model's per-frame actions for a ``step`` (or one chunk of a ``generate``)."""
    return [
        FrameAction(
            keys=frozenset(a.keys),
            mouse=(float(a.mouse[0]), float(a.mouse[1])),
            vector=None if a.vector is None else tuple(float(v) for v in a.vector),
        )
        for a in actions
    ]


def model_info(spec: ModelSpec) -> m.ModelInfo:
    """``ready.model`` for a world's spec."""
    space = spec.action_space
    return m.ModelInfo(
        id=spec.id,
        fps=float(spec.fps),
        chunk_frames=spec.chunk_frames,
        width=spec.width,
        height=spec.height,
        action_space=m.ActionSpace(keys=space.keys, mouse=space.mouse, vector_dim=space.vector_dim),
    )


def ready(session: Session, codec: m.CodecInfo) -> m.Ready:
    """``ready`` for a session, without ``frame`` (the pipeline adds it, encoded off the loop)."""
    return m.Ready(
        session_id=session.id,
        resume_token=session.resume_token,
        model=model_info(session.spec),
        codec=codec,
        chunk=session.last_chunk,
    )


def oneshot_ready(spec: ModelSpec, codec: m.CodecInfo) -> m.Ready:
    """The ``ready`` a one-shot ``generate`` starts with: a run id, and no resume token (a one-shot
    cannot be resumed)."""
    return m.Ready(session_id=uuid.uuid4().hex, resume_token="", model=model_info(spec), codec=codec)


def ready_frame(codec: m.Codec, image: np.ndarray) -> np.ndarray | bytes:
    """``ready.frame`` for an (H, W, 3) uint8 image: the array itself for raw sessions, else one
    JPEG (an H.264 stream cannot start with a lone picture, and every client decodes JPEG)."""
    return image if codec == "raw" else encode_still(image)


def frames(event: FramesEvent, codec: m.Codec, chunk: EncodedChunk, encode_ms: float) -> m.Frames:
    """The ``frames`` message of one committed chunk, with the encode time added to its timings."""
    return m.Frames(
        chunk=event.chunk,
        frame0=event.frame0,
        count=event.frames.shape[0],
        codec=codec,
        key=chunk.key,
        data=chunk.data,
        action_seq=event.action_seq if event.action_seq >= 0 else None,  # -1: no action applied yet
        timings={**event.timings, "encode": round(encode_ms, 3)},
        prompt_seq=event.prompt_seq,
    )


def cancelled(event: CancelledEvent) -> m.Cancelled:
    """``cancelled`` for a session's cancel event."""
    return m.Cancelled(seq=event.seq, chunk=event.chunk, prompt_seq=event.prompt_seq)


def done(event: DoneEvent) -> m.Done:
    """``done`` for a finished one-shot."""
    return m.Done(chunks=event.chunks, frames=event.frames, timings=event.timings)


def error_event(event: ErrorEvent, *, fatal: bool | None = None) -> ProtocolError:
    """The protocol error for a session's error event (``fatal`` overrides the event's)."""
    return ProtocolError(
        ErrorCode(event.code), event.message, seq=event.seq, fatal=event.fatal if fatal is None else fatal
    )


def protocol_error(exc: SessionError, seq: int | None, *, fatal: bool | None = None) -> ProtocolError:
    """The protocol error for a session-layer exception; invalid_field messages start with the field."""
    message = exc.message
    if exc.field and not message.startswith(f"{exc.field}:"):
        message = f"{exc.field}: {message}"
    return ProtocolError(
        ErrorCode(exc.code),
        message,
        seq=seq,
        fatal=exc.fatal if fatal is None else fatal,
        field=exc.field,
    )

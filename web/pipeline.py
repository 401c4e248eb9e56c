"""One connection's outgoing messages, in order: session events and replies in, wire bytes out.

Everything the connection sends goes through :meth:`Pipeline.put` (it is also the session's
sink), so replies never overtake the frames committed before them. A ``frames`` event is encoded
and packed in the encode pool, never on the event loop, one chunk at a time (an encoder is
stateful); the bytes then go to the :class:`~web.outbox.Outbox`, which applies the drop policy.
A ``ReadyEvent`` (open, resume, reset, one-shot start) becomes the attached session's ``ready``
with the event's chunk and frame, the frame encoded in the pool too.
When the outbox drops H.264 frames it asks for a keyframe, and the next chunk is encoded with one.

The queue is bounded (``max_items``): a session's frames are bounded by its credits and control
replies by the client's rate limit, so a full queue means the client stopped reading, and the
connection is closed (:class:`OutboxOverflow`, like the outbox's own control limit). A one-shot
has no credits: it awaits :meth:`Pipeline.room` before each chunk instead.
"""

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from sessions.events import (
    CancelledEvent,
    ClosedEvent,
    DoneEvent,
    ErrorEvent,
    FramesEvent,
    ReadyEvent,
    SessionEvent,
)
from web import codec, convert, metrics
from web import messages as m
from web.encoders import FrameEncoder
from web.errors import CloseCode, ErrorCode, close_code
from web.outbox import Outbox, OutboxOverflow

__all__ = ["CloseRequest", "Pipeline", "close_code_for"]

log = logging.getLogger(__name__)

GOING_AWAY = 1001  # RFC 6455: the server is shutting down


@dataclass(frozen=True)
class CloseRequest:
    """Close the socket once everything put before this is sent."""

    code: int  # websocket close code
    reason: str  # close reason (short text)


Outgoing = SessionEvent | m.ServerMessage | CloseRequest


def close_code_for(reason: str) -> int:
    """The websocket close code after ``closed`` with this reason (sessions' FINISHED_REASON)."""
    if reason == "error":
        return CloseCode.INTERNAL
    if reason == "shutdown":
        return GOING_AWAY
    return CloseCode.NORMAL


class Pipeline:
    """Ordered, encoding delivery of one connection's messages into its outbox."""

    def __init__(self, outbox: Outbox, pool: Executor, max_items: int = 2048) -> None:
        self.outbox = outbox
        self.pool = pool  # the server's encode pool
        self.max_items = max_items  # items queued before the connection is given up as not reading
        self.encoder: FrameEncoder | None = None  # the attached session's encoder
        self.ready: m.Ready | None = None  # the attached session's `ready`, sent for each ReadyEvent
        self.close_code: int | None = None  # set after a fatal error: the code the socket closes with
        self._queue: asyncio.Queue[Outgoing] = asyncio.Queue()
        self._want_key = False  # the outbox dropped H.264 frames: the next chunk starts with an IDR
        self._frames_queued = 0  # FramesEvents put and not yet in the outbox
        self._overflow: OutboxOverflow | None = None  # set by put() on a full queue; raised by run()
        self._room = asyncio.Event()  # a chunk left the pipeline or the outbox: room() re-checks
        self.debug = log.isEnabledFor(logging.DEBUG)
        outbox.on_drop = self._need_keyframe
        outbox.on_pop = self._room.set

    def attach(self, encoder: FrameEncoder, ready: m.Ready, lossless: bool = False) -> None:
        """Use ``encoder`` (one per attached session) for every chunk from now on, and ``ready``
        (chunk and frame filled in per event) for every ReadyEvent; ``lossless`` (one-shots): the
        outbox never drops frames, and the producer paces itself with room()."""
        self.encoder = encoder
        self.ready = ready
        self.outbox.codec = encoder.codec
        self.outbox.lossless = lossless
        self._want_key = False

    def put(self, item: Outgoing) -> None:
        """Queue a session event, a server message or a close (never blocks; the session's sink).
        On a full queue the item is not queued and run() raises OutboxOverflow."""
        if self._queue.qsize() >= self.max_items:
            self._overflow = self._overflow or OutboxOverflow(
                f"{self.max_items} messages waiting to be encoded; the client is not reading"
            )
            return
        if isinstance(item, FramesEvent):
            self._frames_queued += 1
        self._queue.put_nowait(item)

    async def room(self) -> None:
        """Wait until fewer chunks than the outbox holds are waiting here and in the outbox."""
        while self._frames_queued + self.outbox.chunks >= self.outbox.max_chunks:
            self._room.clear()
            await self._room.wait()

    async def run(self) -> None:
        """Deliver queued items into the outbox until cancelled. Raises OutboxOverflow."""
        while True:
            if self._overflow is not None:
                raise self._overflow
            item = await self._queue.get()
            if isinstance(item, FramesEvent):
                try:
                    await self._frames(item)
                finally:
                    self._frames_queued -= 1
                    self._room.set()
            elif isinstance(item, ReadyEvent):
                await self._ready(item)
            else:
                self._control(item)

    # -- internals ------------------------------------------------------------------------------

    def _need_keyframe(self) -> None:
        if self.debug:
            log.debug("= frames dropped: next chunk starts with a keyframe")
        self._want_key = True

    async def _frames(self, event: FramesEvent) -> None:
        encoder = self.encoder
        if encoder is None:
            raise RuntimeError("frames before an encoder was attached")
        want_key, self._want_key = self._want_key, False
        loop = asyncio.get_running_loop()
        data, key = await loop.run_in_executor(self.pool, _encode, encoder, event, want_key)
        if self.debug:
            log.debug(
                "> frames chunk=%d frame0=%d key=%s %d bytes", event.chunk, event.frame0, key, len(data)
            )
        self.outbox.put_frames(data, event.frames.shape[0], key)

    async def _ready(self, event: ReadyEvent) -> None:
        encoder, ready = self.encoder, self.ready
        if encoder is None or ready is None:
            raise RuntimeError("ready before a session was attached")
        msg = ready.model_copy(update={"chunk": event.chunk})
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self.pool, _encode_ready, msg, encoder.codec, event.frame)
        if self.debug:
            log.debug("> ready chunk=%d frame=%s %d bytes", event.chunk, event.frame is not None, len(data))
        self.outbox.put_control(data)

    def _control(self, item: Outgoing) -> None:
        msg: m.ServerMessage
        if isinstance(item, CloseRequest):
            self.outbox.put_close(self.close_code or item.code, item.reason)
            return
        if isinstance(item, ClosedEvent):
            self._send(m.Closed(reason=item.reason))
            self.outbox.put_close(self.close_code or close_code_for(item.reason), item.reason)
            return
        if isinstance(item, CancelledEvent):
            msg = convert.cancelled(item)
        elif isinstance(item, ErrorEvent):
            msg = m.Error.from_exception(convert.error_event(item))
        elif isinstance(item, DoneEvent):
            msg = convert.done(item)
        else:
            msg = item
        self._send(msg)

    def _send(self, msg: m.ServerMessage) -> None:
        if isinstance(msg, m.Error):
            metrics.ERRORS.labels(msg.code.value).inc()
            if msg.fatal:
                self.close_code = close_code(ErrorCode(msg.code))
        if self.debug:
            log.debug("> %s", _summary(msg))
        self.outbox.put_control(codec.encode(msg))


def _encode(encoder: FrameEncoder, event: FramesEvent, want_key: bool) -> tuple[bytes, bool]:
    """Encode and pack one chunk (runs in the encode pool)."""
    start = time.perf_counter()
    if want_key:
        encoder.force_keyframe()
    chunk = encoder.encode_chunk(event.frames)
    encode_ms = (time.perf_counter() - start) * 1000
    data = codec.encode(convert.frames(event, encoder.codec, chunk, encode_ms))
    per_frame_ms = (time.perf_counter() - start) * 1000 / event.frames.shape[0]
    metrics.ENCODE_MS.labels(encoder.codec).observe(per_frame_ms)
    return data, chunk.key


def _encode_ready(msg: m.Ready, codec_name: m.Codec, frame: np.ndarray | None) -> bytes:
    """Pack a `ready`, with ``frame`` (the world's latest frame) encoded for the session's codec
    (runs in the encode pool)."""
    if frame is not None:
        msg = msg.model_copy(update={"frame": convert.ready_frame(codec_name, frame)})
    return codec.encode(msg)


def _summary(msg: m.ServerMessage) -> str:
    fields = msg.model_dump(exclude={"type", "data", "model", "timings"}, exclude_none=True)
    return f"{msg.type} {fields}"

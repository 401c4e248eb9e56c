"""Sans-I/O client state shared by the async and the sync SDK: bytes in, replies filed by key.

A transport feeds every server message to :meth:`ClientCore.receive` and waits until
:meth:`ClientCore.take` has the reply it wants. Keys: ``("ready", None)``, ``("step", seq)`` (the
chunk a lockstep step made), ``("cancelled", seq)``, ``("forked", seq)``, ``("prompted", seq)``,
``("pong", t)``, ``("done", None)``. Every chunk is decoded (H.264 needs them all) but handed out
once: after a resume the server re-sends unacked chunks, and those already received are dropped
here. A
``ready``'s ``frame`` (the world's latest frame: an image-started world's start frame) is decoded
too: ``ready.frame`` is an (H, W, 3) uint8 array or None.
"""

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from web import messages as m
from web.codec import parse_server
from web.encoders import ChunkDecoder, decode_jpeg
from web.errors import ServerError, SessionClosed, StepCancelled
from web.sdk.actions import ActionLike, frame_actions
from web.sdk.types import Chunk, Generated

__all__ = ["ENDED", "NO_SEQ", "REWIND", "ClientCore", "Key", "generate_message", "open_message"]

Key = tuple[str, Any]
NO_SEQ = -1  # an awaited reply that no `error` can answer (wire seqs are >= 0 or absent)
ENDED = frozenset({"closed", "done"})  # `closed` reasons that end a session normally
REWIND = ("rewind", None)  # the reply key of a `rewind`: the `ready` that answers it


def open_message(
    model: str | None,
    seed: int | None,
    mode: m.Mode,
    codec: m.Codec,
    token: str | None,
    max_ahead: int,
    debug: dict[str, Any] | None,
    prompt: str | None = None,
) -> m.Open:
    """The `open` both SDKs send (``debug``: the hooks as a plain dict; ``prompt``: text worlds)."""
    hooks = None if debug is None else m.DebugHooks(**debug)
    return m.Open(
        model=model,
        seed=seed,
        prompt=prompt,
        mode=mode,
        codec=codec,
        token=token,
        max_ahead=max_ahead,
        debug=hooks,
    )


def generate_message(
    chunks: int,
    actions: Sequence[ActionLike | Sequence[ActionLike]],
    model: str | None,
    seed: int | None,
    codec: m.Codec,
    token: str | None,
    prompt: str | None = None,
) -> m.Generate:
    """The one-shot `generate` both SDKs send: ``actions[i]`` drives chunk i + 1."""
    return m.Generate(
        model=model,
        seed=seed,
        prompt=prompt,
        chunks=chunks,
        actions=tuple(frame_actions(a) for a in actions),
        codec=codec,
        token=token,
    )


class ClientCore:
    """One client session's state: seq numbers, decoding, dedupe, replies and errors."""

    def __init__(self, codec: m.Codec) -> None:
        self.codec = codec  # the session's frame codec
        self.ready: m.Ready | None = None  # the latest `ready` (cached server metadata)
        self.received = 0  # highest chunk number received
        self.chunks: deque[Chunk] = deque()  # received chunks no step claimed, oldest first
        self.closed: str | None = None  # why the session or the socket ended, once it has
        self._seq = 0
        self._decoder = ChunkDecoder(codec)
        self._awaited: dict[Key, int | None] = {}  # reply key -> the seq an `error` answers it with
        self._replies: dict[Key, Any] = {}  # reply key -> message, chunk or exception
        self._errors: deque[ServerError] = deque()  # errors nobody waited for: raised by the next call
        self._fatal: ServerError | None = None  # a fatal error: raised by every call from now on

    def next_seq(self) -> int:
        """A fresh ``seq`` for a client message."""
        self._seq += 1
        return self._seq

    def expect(self, key: Key, seq: int | None = NO_SEQ) -> None:
        """Someone will wait for ``key``; an `error` carrying ``seq`` answers it instead."""
        self._awaited[key] = seq

    def take(self, key: Key) -> Any:
        """The reply for ``key``, or None if it has not come yet. Raises the error that answered it,
        a fatal error, or SessionClosed once the session or socket ended."""
        if key in self._replies:
            reply = self._replies.pop(key)
            if isinstance(reply, Exception):
                raise reply
            return reply
        self._check_open()
        return None

    def raise_pending(self) -> None:
        """Raise an error nobody waited for (e.g. for a refused `action`), or what :meth:`take` raises."""
        if self._errors:
            raise self._errors.popleft()
        self._check_open()

    def take_chunk(self) -> Chunk | None:
        """The oldest unclaimed chunk, or None if none has come yet. Raises an error nobody waited
        for, or (once the queue is empty) what :meth:`take` raises."""
        if self._errors:
            raise self._errors.popleft()
        if self.chunks:
            return self.chunks.popleft()
        self._check_open()
        return None

    def new_socket(self, codec: m.Codec | None = None) -> None:
        """A new socket for the same session: the server starts a fresh encoder (H.264: an IDR)."""
        self.codec = codec or self.codec
        self._decoder = ChunkDecoder(self.codec)
        self.closed = None
        self._fatal = None

    def connection_lost(self, reason: str) -> None:
        """The socket closed: waiters fail; chunks already queued stay readable."""
        if self.closed is None:
            self.closed = reason
            self._fail_awaited(SessionClosed(reason))

    def receive(self, data: bytes) -> None:
        """File one server message."""
        msg = parse_server(data)
        if isinstance(msg, m.Frames):
            self._frames(msg)
        elif isinstance(msg, m.Ready):
            if isinstance(msg.frame, bytes):  # a JPEG (every codec but raw)
                msg = msg.model_copy(update={"frame": decode_jpeg(msg.frame)})
            self.ready = msg
            self._decoder.set_scale(msg.codec.scale or 1)
            if REWIND in self._awaited:
                self._rewound(msg.chunk)
                self._reply(REWIND, msg)
            else:
                self._reply(("ready", None), msg)
        elif isinstance(msg, m.Cancelled):
            for key, seq in list(self._awaited.items()):
                if key[0] == "step" and seq is not None and seq < msg.seq:  # rolled back
                    self._reply(key, StepCancelled(f"step {seq} was cancelled (by message {msg.seq})"))
            self._reply(("cancelled", msg.seq), msg)
        elif isinstance(msg, m.Forked):
            self._reply(("forked", msg.seq), msg)
        elif isinstance(msg, m.Saved):
            self._reply(("saved", msg.seq), msg)
        elif isinstance(msg, m.Prompted):
            self._reply(("prompted", msg.seq), msg)
        elif isinstance(msg, m.Pong):
            self._reply(("pong", msg.t), msg)
        elif isinstance(msg, m.Done):
            self._reply(("done", None), msg)
        elif isinstance(msg, m.Error):
            self._error(msg.to_exception())
        elif isinstance(msg, m.Closed):
            self.closed = msg.reason
            self._fail_awaited(SessionClosed(msg.reason))

    def generated(self, done: m.Done) -> Generated:
        """A finished one-shot: every received chunk's frames in order, the frame the run started
        from (``ready.frame``), and the server's summary."""
        got = list(self.chunks)
        frames = [c.frames for c in got if len(c.frames)]
        start = None if self.ready is None else self.ready.frame
        return Generated(
            np.concatenate(frames) if frames else np.empty((0, 0, 0, 3), np.uint8), got, done, start
        )

    # -- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self.closed is not None:
            raise SessionClosed(self.closed)

    def _frames(self, msg: m.Frames) -> None:
        frames = self._decoder.decode(msg)
        if msg.chunk <= self.received:
            return  # re-sent after a resume, and we have it
        self.received = msg.chunk
        chunk = Chunk(msg.chunk, msg.frame0, frames, msg.action_seq, dict(msg.timings), msg.prompt_seq)
        key = ("step", msg.action_seq)
        if key in self._awaited:
            self._reply(key, chunk)
        else:
            self.chunks.append(chunk)

    def _rewound(self, chunk: int) -> None:
        """A rewind to `chunk` took effect: the chunks after it are gone (unclaimed ones are
        dropped) and their numbers come again."""
        self.received = chunk
        self.chunks = deque(c for c in self.chunks if c.chunk <= chunk)

    def _reply(self, key: Key, value: Any) -> None:
        if key in self._awaited:
            del self._awaited[key]
            self._replies[key] = value

    def _error(self, exc: ServerError) -> None:
        answered = [key for key, seq in self._awaited.items() if seq == exc.seq]
        for key in answered:
            self._reply(key, exc)
        if exc.fatal:
            self._fatal = exc
            self._fail_awaited(exc)
        elif not answered:
            self._errors.append(exc)

    def _fail_awaited(self, exc: Exception) -> None:
        for key in list(self._awaited):
            self._reply(key, exc)

"""The synchronous SDK, for scripts, notebooks and robot loops (``websockets.sync.client``).

    with Client("127.0.0.1:8000", seed=0) as world:      # lockstep, raw frames by default
        frames = world.step({"keys": ["w"]})              # (T, H, W, 3) uint8

The constructor connects, retrying while nothing listens for at most ``connect_timeout`` seconds
(then :exc:`~web.errors.ServerUnreachable`, naming the URL), and caches the ``ready`` metadata.
Replies are read inline: every call sends, then reads messages until its own has been filed.
"""

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from web import messages as m
from web.codec import encode
from web.errors import ServerUnreachable, SessionClosed
from web.sdk.actions import ActionLike, frame_actions, vector_array
from web.sdk.base import BaseWorld
from web.sdk.core import ENDED, REWIND, ClientCore, Key, generate_message, open_message
from web.sdk.types import Chunk, Generated
from web.sdk.urls import CLIENT_MAX_SIZE, CONNECT_TIMEOUT_S, RETRY_S, session_url

__all__ = ["Client", "generate"]

log = logging.getLogger(__name__)


def _connect(url: str, timeout_s: float) -> ClientConnection:
    """Connect, retrying while nothing listens yet (a server still loading its worlds) for at most
    ``timeout_s``. Raises ServerUnreachable once that has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return connect(
                url,
                proxy=None,
                compression=None,
                max_size=CLIENT_MAX_SIZE,
                open_timeout=max(left, RETRY_S),  # the TCP connect and the handshake share the budget
                legacy=True,
            )
        except OSError as exc:  # refused, unreachable, or the handshake timed out
            if left <= RETRY_S:
                raise ServerUnreachable(url, timeout_s, exc) from exc
            log.info("waiting for the server at %s: %s", url, exc)
            time.sleep(RETRY_S)


class Client(BaseWorld):
    """One session (sync). ``resume=TOKEN`` attaches to a live session instead of opening one;
    ``restore=DATA`` opens a new session from a save game (`snapshot`'s bytes), in ``mode``.

    ``connect_timeout``: seconds to keep trying to reach the server (it may still be starting)
    before raising :exc:`~web.errors.ServerUnreachable`; ``timeout_s``: seconds to wait for
    each reply (None: forever).
    """

    def __init__(
        self,
        url: str = "127.0.0.1:8000",
        *,
        model: str | None = None,
        seed: int | None = None,
        prompt: str | None = None,
        mode: m.Mode = "lockstep",
        codec: m.Codec = "raw",
        token: str | None = None,
        max_ahead: int = 2,
        debug: dict[str, Any] | None = None,
        resume: str | None = None,
        restore: bytes | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        timeout_s: float | None = None,
    ) -> None:
        self.url = url  # the server, as given
        self.connect_timeout = connect_timeout  # how long to retry connecting
        self.timeout_s = timeout_s  # how long to wait for a reply; None: forever
        self.core = ClientCore(codec)
        self._ws: ClientConnection | None = None
        if resume is not None and restore is not None:
            raise ValueError("resume= attaches to a live session, restore= opens a save game: not both")
        if resume is not None:
            self._start(session_url(url, resume=resume, codec=codec), None)
        elif restore is not None:
            self._start(session_url(url), m.Restore(data=restore, mode=mode, codec=codec, token=token))
        else:
            opening = open_message(model, seed, mode, codec, token, max_ahead, debug, prompt)
            self._start(session_url(url), opening)

    @property
    def ready(self) -> m.Ready:
        """The server's latest ``ready`` (model, codec, session id, resume token)."""
        if self.core.ready is None:
            raise SessionClosed("no `ready` yet")
        return self.core.ready

    def _start(self, url: str, first: m.ClientMessage | None, reply: Key = ("ready", None)) -> Any:
        self.core.expect(reply, None)
        self._ws = _connect(url, self.connect_timeout)
        try:
            if first is not None:
                self.send(first)
            return self._wait(reply)
        except BaseException:
            self._ws.close()
            self._ws = None
            raise

    def send(self, msg: m.ClientMessage) -> None:
        """Send one protocol message as is."""
        if self._ws is None:
            raise SessionClosed("not connected")
        try:
            self._ws.send(encode(msg))
        except ConnectionClosed as exc:
            raise SessionClosed("socket closed") from exc

    def _pump(self, deadline: float | None) -> None:
        """Read and file one message (TimeoutError past ``deadline``)."""
        assert self._ws is not None
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            self.core.receive(self._ws.recv(timeout))  # type: ignore[arg-type] - binary frames only
        except ConnectionClosed:
            self.core.connection_lost(f"socket closed ({self._ws.close_code})")

    def _deadline(self) -> float | None:
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def _wait(self, key: Key) -> Any:
        deadline = self._deadline()
        while (reply := self.core.take(key)) is None:
            self._pump(deadline)
        return reply

    def _call(self, msg: m.ClientMessage, key: Key, seq: int | None) -> Any:
        self.core.expect(key, seq)
        self.send(msg)
        return self._wait(key)

    def step(self, actions: ActionLike | Sequence[ActionLike]) -> np.ndarray:
        seq = self.core.next_seq()
        chunk = self._call(m.Step(seq=seq, actions=frame_actions(actions)), ("step", seq), seq)
        self.send(m.Ack(chunk=chunk.chunk))
        return chunk.frames

    def act(
        self, keys: Sequence[str] = (), mouse: tuple[float, float] = (0.0, 0.0), vector: Any = None
    ) -> int:
        """Realtime input; returns its seq."""
        self.core.raise_pending()
        seq = self.core.next_seq()
        self.send(m.Action(seq=seq, keys=tuple(keys), mouse=mouse, vector=vector_array(vector)))
        return seq

    def next_chunk(self) -> Chunk | None:
        """The next chunk no step claimed (acked as returned); None once the session ended."""
        deadline = self._deadline()
        while True:
            try:
                chunk = self.core.take_chunk()
            except SessionClosed as exc:
                if exc.reason in ENDED:
                    return None
                raise
            if chunk is not None:
                self.send(m.Ack(chunk=chunk.chunk))
                return chunk
            self._pump(deadline)

    def chunks(self) -> Iterator[Chunk]:
        """Every chunk as it arrives, acked and deduplicated, until the session ends."""
        while (chunk := self.next_chunk()) is not None:
            yield chunk

    def pause(self) -> None:
        """Stop realtime generation."""
        self.send(m.Pause(seq=self.core.next_seq()))

    def resume(self) -> None:
        """Restart realtime generation."""
        self.send(m.Resume(seq=self.core.next_seq()))

    def cancel(self) -> m.Cancelled:
        """Roll back the chunks in flight."""
        seq = self.core.next_seq()
        return self._call(m.Cancel(seq=seq), ("cancelled", seq), seq)

    def reset(self, seed: int | None = None, prompt: str | None = None) -> m.Ready:
        seq = self.core.next_seq()
        return self._call(m.Reset(seq=seq, seed=seed, prompt=prompt), ("ready", None), seq)

    def rewind(self, chunk: int) -> m.Ready:
        """Roll the world back to the end of chunk ``chunk`` (see the async SDK's `rewind`)."""
        seq = self.core.next_seq()
        return self._call(m.Rewind(seq=seq, chunk=chunk), REWIND, seq)

    def prompt(self, text: str) -> int:
        """Switch a text world's prompt (the async `Session.prompt`); the message's seq."""
        seq = self.core.next_seq()
        self._call(m.PromptSwitch(seq=seq, text=text), ("prompted", seq), seq)
        return seq

    def fork(self) -> str:
        """Copy the committed world into a new detached session; its resume token."""
        seq = self.core.next_seq()
        return self._call(m.Fork(seq=seq), ("forked", seq), seq).resume_token

    def snapshot(self) -> bytes:
        """A save game of the session as committed now (the async `Session.snapshot`)."""
        seq = self.core.next_seq()
        return self._call(m.Snapshot(seq=seq), ("saved", seq), seq).data

    def reconnect(self, codec: m.Codec | None = None) -> m.Ready:
        """Resume this session on a new socket (after a drop); chunks already received are skipped."""
        if self._ws is not None:
            self._ws.close()
        self.core.new_socket(codec)
        return self._start(session_url(self.url, resume=self.ready.resume_token, codec=codec), None)

    def close(self) -> None:
        """End the session and the socket."""
        if self._ws is None:
            return
        if self.core.closed is None:
            try:
                self.send(m.Close())
                while self.core.closed is None:
                    self._pump(time.monotonic() + 10)
            except (SessionClosed, TimeoutError):
                pass
        self._ws.close()
        self._ws = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def generate(
    url: str,
    *,
    chunks: int,
    actions: Sequence[ActionLike | Sequence[ActionLike]] = (),
    model: str | None = None,
    seed: int | None = None,
    prompt: str | None = None,
    codec: m.Codec = "raw",
    token: str | None = None,
    connect_timeout: float = CONNECT_TIMEOUT_S,
) -> Generated:
    """One-shot: ``chunks`` chunks, ``actions[i]`` driving chunk i + 1; every frame, in order."""
    core = ClientCore(codec)
    core.expect(("done", None), None)
    msg = generate_message(chunks, actions, model, seed, codec, token, prompt)
    with _connect(session_url(url), connect_timeout) as ws:
        ws.send(encode(msg))
        try:
            while (done := core.take(("done", None))) is None:
                core.receive(ws.recv())  # type: ignore[arg-type]
        except ConnectionClosed:
            core.connection_lost("socket closed")
            done = core.take(("done", None))
    return core.generated(done)

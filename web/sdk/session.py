"""The async SDK's session: one reader task files server messages, calls wait for their replies.

Every server message goes to the shared :class:`~web.sdk.core.ClientCore`; a call sends its
message and waits until the core holds the reply. Chunks are acked as they are handed out, which
is what paces a realtime session. Open one with :func:`web.sdk.connect`.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from web import messages as m
from web.codec import encode
from web.errors import ServerUnreachable, SessionClosed, WebError
from web.sdk.actions import ActionLike, frame_actions, vector_array
from web.sdk.core import ENDED, REWIND, ClientCore, Key
from web.sdk.types import Chunk
from web.sdk.urls import CLIENT_MAX_SIZE, CONNECT_TIMEOUT_S, RETRY_S, session_url

__all__ = ["Session"]


async def _dial(url: str, timeout_s: float) -> ClientConnection:
    """Connect, retrying while nothing listens yet for at most ``timeout_s`` (ServerUnreachable)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        left = deadline - asyncio.get_running_loop().time()
        try:
            # proxy=None: websockets >= 15 would pick up a system proxy, even for loopback
            return await connect(
                url, proxy=None, compression=None, max_size=CLIENT_MAX_SIZE, open_timeout=max(left, RETRY_S)
            )
        except OSError as exc:  # refused, unreachable, or the handshake timed out
            if left <= RETRY_S:
                raise ServerUnreachable(url, timeout_s, exc) from exc
            await asyncio.sleep(RETRY_S)


class Session:
    """One session over a websocket (async)."""

    def __init__(self, url: str, core: ClientCore, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.url = url  # the server, as given
        self.core = core
        self.connect_timeout = connect_timeout  # seconds to keep trying to reach the server
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # replaced on every message; waiters hold the old one

    @property
    def ready(self) -> m.Ready:
        """The server's latest ``ready`` (model, codec, session id, resume token)."""
        if self.core.ready is None:
            raise SessionClosed("no `ready` yet")
        return self.core.ready

    async def start(self, url: str, first: m.ClientMessage | None, reply: Key = ("ready", None)) -> Any:
        """Dial ``url`` (retrying for at most ``connect_timeout`` s, then ServerUnreachable), send
        ``first`` (None: the server speaks first), return the ``reply``."""
        self.core.expect(reply, None)  # before dialing: a resumed session's `ready` comes at once
        self._ws = await _dial(url, self.connect_timeout)
        self._reader = asyncio.create_task(self._read(self._ws))
        if first is not None:
            await self.send(first)
        return await self._wait(reply)

    async def _read(self, ws: ClientConnection) -> None:
        reason = "socket closed"
        try:
            async for data in ws:
                self.core.receive(data)  # type: ignore[arg-type] - a text frame fails to parse
                self._notify()
        except ConnectionClosed:
            pass
        except WebError as exc:  # the server broke the protocol: give up on this socket
            reason = f"bad server message: {exc}"
            await ws.close(1002, "protocol error")
        finally:
            self.core.connection_lost(f"{reason} ({ws.close_code})")
            self._notify()

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def _wait(self, key: Key) -> Any:
        while True:
            changed = self._changed
            reply = self.core.take(key)
            if reply is not None:
                return reply
            await changed.wait()

    async def send(self, msg: m.ClientMessage) -> None:
        """Send one protocol message as is (most users call the methods below)."""
        if self._ws is None:
            raise SessionClosed("not connected")
        try:
            await self._ws.send(encode(msg))
        except ConnectionClosed as exc:
            raise SessionClosed(f"socket closed ({self._ws.close_code})") from exc

    async def _call(self, msg: m.ClientMessage, key: Key, seq: int | None) -> Any:
        self.core.expect(key, seq)
        await self.send(msg)
        return await self._wait(key)

    async def call(self, msg: m.ClientMessage, key: Key, seq: int | None) -> Any:
        """Send ``msg`` and wait for the reply filed under ``key`` (see :mod:`web.sdk.core`); an
        `error` carrying ``seq`` answers it instead."""
        return await self._call(msg, key, seq)

    # -- lockstep -------------------------------------------------------------------------------

    async def step(self, actions: ActionLike | Sequence[ActionLike]) -> np.ndarray:
        """Lockstep: one chunk with these actions (one for all frames, or one per frame);
        its frames, (T, H, W, 3) uint8."""
        seq = self.core.next_seq()
        chunk = await self._call(m.Step(seq=seq, actions=frame_actions(actions)), ("step", seq), seq)
        await self.send(m.Ack(chunk=chunk.chunk))
        return chunk.frames

    # -- realtime -------------------------------------------------------------------------------

    async def act(
        self,
        keys: Sequence[str] = (),
        mouse: tuple[float, float] = (0.0, 0.0),
        vector: Sequence[float] | np.ndarray | None = None,
    ) -> int:
        """Realtime input (keys held now, mouse motion since the last call); returns its seq."""
        self.core.raise_pending()
        seq = self.core.next_seq()
        await self.send(m.Action(seq=seq, keys=tuple(keys), mouse=mouse, vector=vector_array(vector)))
        return seq

    async def next_chunk(self) -> Chunk | None:
        """The next chunk no step claimed, acked as it is returned; None once the session ended."""
        while True:
            changed = self._changed
            try:
                chunk = self.core.take_chunk()
            except SessionClosed as exc:
                if exc.reason in ENDED:
                    return None
                raise
            if chunk is not None:
                await self.send(m.Ack(chunk=chunk.chunk))
                return chunk
            await changed.wait()

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Every chunk as it arrives, acked and deduplicated, until the session ends."""
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def pause(self) -> None:
        """Stop realtime generation (the chunk in flight still arrives)."""
        self.core.raise_pending()
        await self.send(m.Pause(seq=self.core.next_seq()))

    async def resume(self) -> None:
        """Restart realtime generation."""
        self.core.raise_pending()
        await self.send(m.Resume(seq=self.core.next_seq()))

    # -- both modes -----------------------------------------------------------------------------

    async def cancel(self) -> m.Cancelled:
        """Roll back the chunks in flight; steps waiting for them raise StepCancelled."""
        seq = self.core.next_seq()
        return await self._call(m.Cancel(seq=seq), ("cancelled", seq), seq)

    async def reset(self, seed: int | None = None, prompt: str | None = None) -> m.Ready:
        """A fresh world in the same session (None: the same seed / prompt); the new ``ready``."""
        seq = self.core.next_seq()
        return await self._call(m.Reset(seq=seq, seed=seed, prompt=prompt), ("ready", None), seq)

    async def rewind(self, chunk: int) -> m.Ready:
        """Roll the world back to the end of chunk ``chunk`` (within the server's retention);
        the ``ready`` naming it, with its last frame. Steps still waiting raise StepCancelled;
        unclaimed chunks after it are dropped and their numbers come again. ServerError with
        code ``not_retained`` when the server no longer holds that chunk (nothing changed)."""
        seq = self.core.next_seq()
        return await self._call(m.Rewind(seq=seq, chunk=chunk), REWIND, seq)

    async def prompt(self, text: str) -> int:
        """Switch a text world's prompt: returns once the server encoded it (``prompted``), with
        the message's seq; the next chunk (lockstep: the next :meth:`step`) is generated under it
        and its :class:`Chunk` carries ``prompt_seq`` = that seq. InvalidField for a world
        without prompts or a prompt it cannot take (the session goes on)."""
        seq = self.core.next_seq()
        await self._call(m.PromptSwitch(seq=seq, text=text), ("prompted", seq), seq)
        return seq

    async def fork(self) -> str:
        """Copy the committed world into a new detached session; its resume token."""
        seq = self.core.next_seq()
        forked: m.Forked = await self._call(m.Fork(seq=seq), ("forked", seq), seq)
        return forked.resume_token

    async def snapshot(self) -> bytes:
        """A save game of the session as committed now (`saved.data`): open it again, on this
        server or another with the same model weights, with :func:`~web.sdk.aio.restore`."""
        seq = self.core.next_seq()
        saved: m.Saved = await self._call(m.Snapshot(seq=seq), ("saved", seq), seq)
        return saved.data

    async def ping(self) -> float:
        """Round trip to the server, ms."""
        t = asyncio.get_running_loop().time() * 1000
        await self._call(m.Ping(t=t), ("pong", t), None)
        return asyncio.get_running_loop().time() * 1000 - t

    async def reconnect(self, codec: m.Codec | None = None) -> m.Ready:
        """Resume this session on a new socket (after a drop); chunks already received are skipped."""
        await self.disconnect()
        self.core.new_socket(codec)
        return await self.start(session_url(self.url, resume=self.ready.resume_token, codec=codec), None)

    async def disconnect(self) -> None:
        """Close the socket without ending the session: it waits, detached, for :meth:`reconnect`."""
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await self._reader
        self._ws = self._reader = None

    async def close(self) -> None:
        """End the session (``close``) and the socket."""
        if self._ws is not None and self.core.closed is None:
            try:
                await self.send(m.Close())
                if self._reader is not None:
                    await asyncio.wait_for(asyncio.shield(self._reader), timeout=10)  # until `closed`
            except (SessionClosed, TimeoutError):
                pass
        await self.disconnect()

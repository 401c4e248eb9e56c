"""One websocket connection speaking protocol v1: read, parse, dispatch, reply.

A connection holds at most one session (opened here, or attached with ``?resume=TOKEN``) or one
one-shot run. It has three tasks: the handler's own loop reads and dispatches client messages in
order; the pipeline task turns replies and session events into bytes (encoding off the loop); the
writer task sends the outbox. Errors: every ``ProtocolError`` (parsing) and ``SessionError``
(session layer) becomes an ``error`` message; a fatal one ends the session and closes the socket
with the error's close code (:meth:`Connection.fail`). Nothing a client sends can raise out of
:meth:`Connection.run`.

Abuse limits, all per connection: messages pass a token bucket before parsing and are charged
for the maps and arrays they held after it (parse work, not only message count, is what a
flood costs the event loop); excess messages are dropped with `rate_limited` errors that are
themselves rate-limited, so replies to a flood cannot flood the outbox. A message is reassembled
here from its fragments with a byte and fragment cap (`too_large`, not websockets' bare 1009).
Forks and the sessions they create are capped. Timeouts (:meth:`Connection._idle_at`): a
connection without a session is closed a fixed time after its handshake, whatever it sends (else
a client that pings would hold its slot forever); one with a session, when neither the client
nor the session did anything for the idle timeout (`closed{idle}`): a chunk in flight is not
idle, and a session's event (a step's `frames`) restarts the time like a client message.
"""

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from models.world import ModelSpec
from sessions.errors import SessionBusy, SessionError
from sessions.events import ClosedEvent, ErrorEvent, ReadyEvent, SessionEvent
from sessions.session import Session, SessionStatus
from web import codec, convert, metrics
from web import messages as m
from web.encoders import FrameEncoder, make_encoder
from web.errors import ErrorCode, MediaError, ProtocolError
from web.hub import Hub
from web.outbox import Outbox, OutboxOverflow
from web.pipeline import GOING_AWAY, CloseRequest, Pipeline
from web.ratelimit import TokenBucket

__all__ = ["Connection"]

log = logging.getLogger(__name__)

CODECS: tuple[m.Codec, ...] = ("h264", "jpeg", "raw")
# Failures of `open`/`generate` that leave the client nothing to do on this socket.
OPEN_FATAL = frozenset({ErrorCode.BUSY, ErrorCode.NOT_FOUND, ErrorCode.UNAUTHORIZED, ErrorCode.INTERNAL})
FLUSH_TIMEOUT_S = 10.0  # how long a closing connection waits for its outbox to drain
MAX_FRAGMENTS = 4096  # websocket frames per message: only hostile clients send 4096 tiny ones
CONTAINERS_PER_TOKEN = 16  # a message's maps and arrays cost one rate-limit token per this many
REFUSALS_PER_S = 2.0  # `rate_limited` errors sent per second at most (the rest are dropped too)


class Connection:
    """The server side of one websocket (see the module docstring)."""

    def __init__(self, ws: ServerConnection, hub: Hub) -> None:
        self.ws = ws
        self.hub = hub
        self.manager = hub.manager
        self.session: Session | None = None  # the attached session
        self.oneshot: asyncio.Task[None] | None = None  # the running `generate`
        self.closing = False  # a close is queued; stop reading
        self.debug = log.isEnabledFor(logging.DEBUG)
        self._wake = asyncio.Event()  # the outbox has items
        self.outbox = Outbox(max_chunks=hub.config.outbox_chunks, on_ready=self._wake.set)
        self.pipeline = Pipeline(self.outbox, hub.pool)
        self.bucket = TokenBucket(hub.config.rate, hub.config.burst)
        self.refusals = TokenBucket(REFUSALS_PER_S, 1)  # `rate_limited` replies
        self.created: list[Session] = []  # sessions this connection opened or forked (pruned)
        self.forks = 0  # forks made so far
        self._closer: asyncio.Task[None] | None = None  # closes the socket when the pipeline failed
        self._loop = asyncio.get_running_loop()
        self._connected_at = self._loop.time()  # the open timeout counts from here
        self._active_at = self._connected_at  # last client message or session event (idle timeout)
        self._idle_check: asyncio.TimerHandle | None = None  # re-evaluates `_idle_at` during a read
        self._handlers: dict[str, Callable[[Any], Awaitable[None]]] = {
            "open": self._open,
            "generate": self._generate,
            "action": self._action,
            "step": self._step,
            "cancel": self._cancel,
            "pause": self._pause,
            "resume": self._resume,
            "reset": self._reset,
            "rewind": self._rewind,
            "prompt": self._prompt,
            "fork": self._fork,
            "ack": self._ack,
            "ping": self._ping,
            "close": self._close,
            "snapshot": self._snapshot,
            "restore": self._restore,
        }
        self._saving = False  # a `snapshot` is being taken (one at a time per connection)

    # -- lifecycle ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until the socket closes."""
        metrics.CONNECTIONS.inc()
        metrics.CONNECTIONS_TOTAL.inc()
        sock = self.ws.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.hub.config.send_buffer)
        writer = asyncio.create_task(self._write(), name="ws-writer")
        pump = asyncio.create_task(self.pipeline.run(), name="ws-pipeline")
        pump.add_done_callback(self._pipeline_done)
        try:
            await self._guard(self._attach_from_query, None)
            if self.closing:
                await asyncio.wait_for(asyncio.shield(writer), FLUSH_TIMEOUT_S)
                return
            while not self.closing:
                data = await self._next_message()
                if data is None:
                    self._idle()
                    break
                await self._receive(data)
                await asyncio.sleep(0)  # let the pipeline and writer drain what this message queued
            if self.closing:
                await asyncio.wait_for(asyncio.shield(writer), FLUSH_TIMEOUT_S)
        except (ConnectionClosed, TimeoutError):
            pass
        finally:
            self._leave()
            pump.cancel()
            writer.cancel()
            metrics.CONNECTIONS.dec()

    def evict(self) -> None:
        """Another connection resumed our session: let go of it and close this socket."""
        if self.debug:
            log.debug("= %s: session attached elsewhere", self.ws.id)
        self.session = None
        self.closing = True
        self.pipeline.put(CloseRequest(1000, "session resumed on another connection"))

    def shutdown(self) -> None:
        """The server is stopping: a running one-shot ends with `closed` (reason shutdown) and a
        socket with nothing attached closes (1001); an attached session's `closed` comes from
        the manager's shutdown. What is queued before it is still sent (the server bounds that)."""
        if self.closing or self.session is not None:
            return
        self.closing = True
        if self.oneshot is not None:
            self.oneshot.cancel()
            self.oneshot = None
            self.pipeline.put(ClosedEvent("shutdown"))
        else:
            self.pipeline.put(CloseRequest(GOING_AWAY, "server shutting down"))

    def fail(self, error: ProtocolError) -> None:
        """Send ``error``; a fatal one ends the session and closes the socket with its close code."""
        self.pipeline.put(m.Error.from_exception(error))
        if not error.fatal or self.closing:
            return
        self.closing = True
        if self.oneshot is not None:
            self.oneshot.cancel()
        session, self.session = self.session, None
        if session is not None and self.hub.owns(session, self):
            self.hub.release(session, self)
            if not session.status.is_finished:
                status = SessionStatus.FAILED if error.code is ErrorCode.INTERNAL else SessionStatus.CLOSED
                session.finish(status)  # its ClosedEvent reaches the pipeline: `closed`, then the close
                return
        self.pipeline.put(CloseRequest(1000, error.code.value))  # the pipeline uses the error's code

    def _idle(self) -> None:
        """The connection is idle (`_idle_at`): end the session (`closed{idle}`) and the socket."""
        if self.debug:
            log.debug("= %s idle", self.ws.id)
        self.closing = True
        session, self.session = self.session, None
        if session is not None and self.hub.owns(session, self):
            self.hub.release(session, self)
            if not session.status.is_finished:
                session.finish(SessionStatus.IDLE)  # `closed{idle}`, then the close
                return
        self.pipeline.put(CloseRequest(1000, "idle"))

    def _leave(self) -> None:
        """The socket is gone: a session without `close` stays alive, detached, for its TTL."""
        if self.oneshot is not None:
            self.oneshot.cancel()
        session, self.session = self.session, None
        if session is not None and self.hub.owns(session, self):
            self.hub.release(session, self)
            session.detach()
            if self.debug:
                log.debug("= session %s detached", session.id)

    def _pipeline_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, OutboxOverflow):
            log.warning("closing %s: %s", self.ws.id, exc)
        else:
            log.error("pipeline of %s failed", self.ws.id, exc_info=exc)
        self.closing = True
        self._closer = asyncio.get_running_loop().create_task(
            self.ws.close(1008 if isinstance(exc, OutboxOverflow) else 1011)
        )

    async def _write(self) -> None:
        """The one writer: send the outbox in order; a close item closes the socket."""
        try:
            while True:
                item = self.outbox.pop()
                if item is None:
                    self._wake.clear()
                    await self._wake.wait()
                elif item.close is not None:
                    if self.debug:
                        log.debug("= %s closing: %d %s", self.ws.id, *item.close)
                    await self.ws.close(*item.close)
                    return
                else:
                    await self.ws.send(item.data)
        except ConnectionClosed:
            return  # the reader sees it too and ends the connection

    # -- input ----------------------------------------------------------------------------------

    async def _next_message(self) -> bytes | str | ProtocolError | None:
        """The next client message, reassembled from its fragments, or the fatal too_large it
        earned (over ``max_message`` bytes or MAX_FRAGMENTS frames; the rest of it is not read).
        None once the connection is idle (`_idle_at`). Raises ConnectionClosed."""
        try:
            async with asyncio.timeout(None) as timer:
                self._watch(timer)
                return await self._assemble()
        except TimeoutError:
            return None
        finally:
            if self._idle_check is not None:
                self._idle_check.cancel()
                self._idle_check = None

    def _idle_at(self) -> float | None:
        """The loop time at which the connection is idle unless something happens; None: never.
        Without a session: the open timeout after the handshake (messages do not move it);
        with one: the idle timeout after the last client message or session event; a running
        one-shot: never."""
        cfg = self.hub.config
        if self.oneshot is not None:
            return None
        if self.session is None:
            limit = cfg.open_timeout_s or cfg.idle_timeout_s
            return self._connected_at + limit if limit > 0 else None
        return self._active_at + cfg.idle_timeout_s if cfg.idle_timeout_s > 0 else None

    def _watch(self, timer: asyncio.Timeout) -> None:
        """Expire ``timer`` (the current read's) at `_idle_at`, re-evaluated when it comes: a
        session with a chunk in flight is not idle, so its idle time restarts then (the chunk's
        event restarts it again when it resolves)."""
        self._idle_check = None
        when = self._idle_at()
        if when is None:
            return
        now = self._loop.time()
        if when <= now and self.session is not None and self.session.outstanding:
            self._active_at = now
            when = now + self.hub.config.idle_timeout_s
        if when <= now:
            timer.reschedule(now)
        else:
            self._idle_check = self._loop.call_at(when, self._watch, timer)

    def _message_limit(self) -> int:
        """Bytes the next client message may have: `max_message`, or before anything is attached
        the larger `max_snapshot` (a `restore` carries a save game; `_receive` holds any other
        message to `max_message`)."""
        cfg = self.hub.config
        fresh = self.session is None and self.oneshot is None
        return max(cfg.max_message, cfg.max_snapshot) if fresh else cfg.max_message

    async def _assemble(self) -> bytes | str | ProtocolError:
        limit = self._message_limit()
        parts: list[Any] = []
        size = 0
        async for part in self.ws.recv_streaming():
            parts.append(part)
            size += len(part)
            if size > limit:
                return ProtocolError(ErrorCode.TOO_LARGE, f"message of more than {limit} bytes", fatal=True)
            if len(parts) > MAX_FRAGMENTS:
                return ProtocolError(
                    ErrorCode.TOO_LARGE, f"message in more than {MAX_FRAGMENTS} fragments", fatal=True
                )
        return "".join(parts) if isinstance(parts[0], str) else b"".join(parts)

    async def _receive(self, data: bytes | str | ProtocolError) -> None:
        self._active_at = self._loop.time()  # any message restarts the idle time (not the open timeout)
        if isinstance(data, ProtocolError):
            self.fail(data)
            return
        if not self.bucket.take():  # before parsing: a flood of garbage is limited too
            if self.refusals.take():
                self.fail(ProtocolError(ErrorCode.RATE_LIMITED, "too many messages; slow down"))
            return
        cost = codec.ParseCost()
        try:
            msg = codec.parse_client(data, max_size=self._message_limit(), cost=cost)
            limit = self.hub.config.max_message
            if len(data) > limit and msg.type != "restore":
                raise ProtocolError(
                    ErrorCode.TOO_LARGE, f"message of {len(data)} bytes; at most {limit}", fatal=True
                )
        except ProtocolError as exc:
            self.fail(exc)
            return
        finally:
            self.bucket.charge(cost.containers / CONTAINERS_PER_TOKEN)
        metrics.MESSAGES_IN.labels(msg.type).inc()
        if self.debug:
            log.debug(
                "< %s %s", msg.type, msg.model_dump(exclude={"type", "image", "token"}, exclude_none=True)
            )
        await self._guard(self._handlers[msg.type], msg, getattr(msg, "seq", None))

    async def _guard(
        self, handler: Callable[[Any], Awaitable[None]], msg: Any, seq: int | None = None
    ) -> None:
        """Run a handler; every exception becomes an `error` (unexpected ones: internal, fatal)."""
        try:
            await handler(msg)
        except ProtocolError as exc:
            self.fail(exc)
        except SessionError as exc:
            self.fail(convert.protocol_error(exc, seq))
        except Exception as exc:
            log.exception("handler for %s failed", getattr(msg, "type", "connect"))
            self.fail(
                ProtocolError(ErrorCode.INTERNAL, f"server error: {type(exc).__name__}", seq=seq, fatal=True)
            )

    def _live(self, msg: Any) -> Session:
        """The attached session, or invalid_field when there is none."""
        if self.session is None:
            what = "a one-shot accepts only ping and close" if self.oneshot else "send open or generate first"
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, f"type: {what}", seq=getattr(msg, "seq", None), field="type"
            )
        return self.session

    def _check_token(self, token: str | None) -> None:
        want = self.hub.config.token
        if want is not None and not secrets.compare_digest((token or "").encode(), want.encode()):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong token", fatal=True)

    def _check_fresh(self) -> None:
        if self.session is not None or self.oneshot is not None:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, "type: this connection already has a session", field="type"
            )

    # -- attach ---------------------------------------------------------------------------------

    async def _attach_from_query(self, _: None) -> None:
        request = self.ws.request
        query = parse_qs(urlsplit(request.path).query if request is not None else "")
        if "resume" not in query:
            return
        try:
            session = self.manager.by_token(query["resume"][0])
        except SessionError as exc:
            raise ProtocolError(ErrorCode.NOT_FOUND, exc.message, fatal=True) from exc
        try:
            await self.manager.ensure_resident(session)  # an offloaded world comes back first
        except SessionError as exc:
            raise replace_fatal(convert.protocol_error(exc, None), True) from exc
        name = query.get("codec", [self.hub.codec_of(session) or "jpeg"])[0]
        if name not in CODECS:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"codec: must be one of {', '.join(CODECS)}",
                field="codec",
                fatal=True,
            )
        encoder, info = await self._encoder(name, session.spec)
        self._attach(session, encoder, info)
        if self.debug:
            log.debug("= session %s resumed at chunk %d", session.id, session.last_chunk)

    async def _encoder(self, name: m.Codec, spec: ModelSpec) -> tuple[FrameEncoder, m.CodecInfo]:
        """A fresh encoder and its `ready.codec`, built in the pool (H.264 probes an encode)."""

        def build() -> tuple[FrameEncoder, m.CodecInfo]:
            encoder = make_encoder(name, spec.width, spec.height, spec.fps)
            return encoder, encoder.info

        try:
            return await asyncio.get_running_loop().run_in_executor(self.hub.pool, build)
        except MediaError as exc:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"codec: {exc}", field="codec") from exc

    def _attach(self, session: Session, encoder: FrameEncoder, info: m.CodecInfo) -> None:
        """Make ``session`` this connection's: `ready`, then retained unacked chunks, then live events."""
        self.hub.claim(session, self, info.name)
        self.session = session
        self.pipeline.attach(encoder, convert.ready(session, info))
        self.pipeline.put(ReadyEvent(session.last_chunk, session.frame))  # `ready`, with the latest frame
        for event in session.activate(self._deliver):  # nothing is emitted before it returns
            self.pipeline.put(event)

    def _deliver(self, event: SessionEvent) -> None:
        """The attached session's sink: its events count as activity for the idle timeout."""
        self._active_at = self._loop.time()
        self.pipeline.put(event)

    # -- handlers -------------------------------------------------------------------------------

    async def _open(self, msg: m.Open) -> None:
        self._check_token(msg.token)
        self._check_fresh()
        try:
            session = await self.manager.open(convert.open_params(msg))
        except SessionError as exc:
            error = convert.protocol_error(exc, None)
            raise replace_fatal(error, error.code in OPEN_FATAL) from exc
        await self._take_new(session, msg.codec)
        if self.debug:
            log.debug("= session %s opened (%s, %s)", session.id, session.spec.id, session.mode)

    async def _take_new(self, session: Session, codec: m.Codec) -> None:
        """Attach a session this connection just created (`open`, `restore`) with its encoder;
        closed again if the encoder cannot be made or the client left while it was being built."""
        try:
            encoder, info = await self._encoder(codec, session.spec)
        except BaseException:
            await self.manager.close(session)
            raise
        if self.closing or self.ws.state is not State.OPEN:
            await self.manager.close(session)  # the client left while its world was being built
            return
        self.created.append(session)
        self._attach(session, encoder, info)

    async def _generate(self, msg: m.Generate) -> None:
        self._check_token(msg.token)
        self._check_fresh()
        model = msg.model or self.manager.default_model
        spec = self.manager.models().get(model)
        if spec is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"unknown model {model!r}", fatal=True)
        encoder, info = await self._encoder(msg.codec, spec)
        # a one-shot owes every frame; it starts with `ready` (the manager's ReadyEvent) too
        self.pipeline.attach(encoder, convert.oneshot_ready(spec, info), lossless=True)
        self.oneshot = asyncio.create_task(self._run_oneshot(msg), name="ws-oneshot")

    async def _run_oneshot(self, msg: m.Generate) -> None:
        failed: list[ErrorEvent] = []

        def sink(event: SessionEvent) -> None:
            if isinstance(event, ErrorEvent):  # the run stops at its first error: that ends it
                event = replace(event, fatal=True)
                failed.append(event)
            self.pipeline.put(event)

        actions = [convert.frame_actions(chunk) for chunk in msg.actions]
        try:
            done = await self.manager.generate(
                convert.open_params(msg), actions, msg.chunks, sink, room=self.pipeline.room
            )
        except SessionError as exc:
            self.oneshot = None
            if failed:
                self.closing = True
                self.pipeline.put(ClosedEvent("error"))
            else:
                error = convert.protocol_error(exc, None)
                self.fail(replace_fatal(error, error.code in OPEN_FATAL))
            return
        self.oneshot = None
        self.closing = True
        self.pipeline.put(done)
        self.pipeline.put(ClosedEvent("done"))

    async def _action(self, msg: m.Action) -> None:
        vector = None if msg.vector is None else msg.vector.tolist()
        self._live(msg).act(msg.seq, msg.keys, msg.mouse, vector)

    async def _step(self, msg: m.Step) -> None:
        self._live(msg).step(msg.seq, convert.frame_actions(msg.actions))

    async def _cancel(self, msg: m.Cancel) -> None:
        self._live(msg).cancel(msg.seq)

    async def _pause(self, msg: m.Pause) -> None:
        self._live(msg).pause()

    async def _resume(self, msg: m.Resume) -> None:
        self._live(msg).resume()

    async def _reset(self, msg: m.Reset) -> None:
        session = self._live(msg)
        # answered by `ready`; a prompt the world cannot take is invalid_field (the session goes on)
        await self.manager.reset(session, msg.seq, msg.seed, msg.prompt)

    async def _rewind(self, msg: m.Rewind) -> None:
        # answered by `ready` (the session's ReadyEvent) or `not_retained` (the session goes on)
        await self._live(msg).rewind(msg.seq, msg.chunk)

    async def _prompt(self, msg: m.PromptSwitch) -> None:
        # answered by `prompted` once encoded, then the `frames` of the first chunk under it carry
        # `prompt_seq`; a world without prompts or a prompt it cannot take is invalid_field `text`
        # (the session goes on under its old prompt)
        await self.manager.switch_prompt(self._live(msg), msg.seq, msg.text)
        self.pipeline.put(m.Prompted(seq=msg.seq))

    async def _fork(self, msg: m.Fork) -> None:
        session = self._live(msg)
        cfg = self.hub.config
        self.created = [s for s in self.created if not s.status.is_finished]
        if self.forks >= cfg.forks_per_connection:
            raise ProtocolError(
                ErrorCode.BUSY, f"at most {cfg.forks_per_connection} forks per connection", seq=msg.seq
            )
        live = {s.id for s in self.created} | {session.id}  # a resumed session counts too
        if len(live) >= cfg.sessions_per_connection:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"at most {cfg.sessions_per_connection} live sessions per connection; "
                "close some or let them expire",
                seq=msg.seq,
            )
        codec = self.hub.codec_of(session) or "jpeg"
        try:
            copy = await self.manager.fork(session)
        except SessionBusy:
            if self.hub.fork_elsewhere is None:
                raise
            # no room here: the copy is made on another server (its live-session count is
            # that server's; the fork still counts against this connection's forks)
            copy_id, token = await self.hub.fork_elsewhere(session, codec)
            self.forks += 1
            self.pipeline.put(m.Forked(seq=msg.seq, session_id=copy_id, resume_token=token))
            return
        self.forks += 1
        self.created.append(copy)
        self.hub.remember_codec(copy, codec)
        self.pipeline.put(m.Forked(seq=msg.seq, session_id=copy.id, resume_token=copy.resume_token))

    async def _ack(self, msg: m.Ack) -> None:
        self._live(msg).ack(msg.chunk)

    async def _ping(self, msg: m.Ping) -> None:
        self.pipeline.put(m.Pong(t=msg.t, server_t=time.time() * 1000))

    async def _close(self, msg: m.Close) -> None:
        self.closing = True
        if self.oneshot is not None:
            self.oneshot.cancel()
            self.oneshot = None
            self.pipeline.put(ClosedEvent("closed"))
            return
        session, self.session = self.session, None
        if session is None:
            self.pipeline.put(CloseRequest(1000, "closed"))
            return
        self.hub.release(session, self)
        await self.manager.close(session)  # its ClosedEvent: `closed`, then the socket closes

    # -- snapshot and restore (v1 additions) ----------------------------------------------------

    async def _snapshot(self, msg: m.Snapshot) -> None:
        session = self._live(msg)
        if self._saving:
            raise ProtocolError(ErrorCode.RATE_LIMITED, "a snapshot is already being taken", seq=msg.seq)
        self._saving = True
        try:
            data, chunk = await self.manager.snapshot(session)
        finally:
            self._saving = False
        cap = self.hub.config.max_snapshot
        if len(data) > cap:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"the snapshot has {len(data)} bytes; this server restores at most {cap} (--max-snapshot)",
                seq=msg.seq,
            )
        self.pipeline.put(m.Saved(seq=msg.seq, chunk=chunk, data=data))

    async def _restore(self, msg: m.Restore) -> None:
        self._check_token(msg.token)
        self._check_fresh()
        try:
            session = await self.manager.restore(msg.data, msg.mode, msg.max_ahead)
        except SessionError as exc:
            raise replace_fatal(convert.protocol_error(exc, None), True) from exc
        await self._take_new(session, msg.codec)

    def suspend(self, reason: str = "server restarting; resume with your token") -> None:
        """The server is stopping and saved this connection's session (or moved it to another
        replica of a cluster): let go of it (it stays alive, detached, until the server lets it
        go) and close with 1001, no `closed`: the client resumes with its token."""
        session, self.session = self.session, None
        if session is None or self.closing:
            return
        self.closing = True
        self.hub.release(session, self)
        session.detach()
        self.pipeline.put(CloseRequest(GOING_AWAY, reason))


def replace_fatal(error: ProtocolError, fatal: bool) -> ProtocolError:
    """``error`` with its ``fatal`` flag set as given."""
    return ProtocolError(error.code, error.message, seq=error.seq, fatal=fatal, field=error.field)

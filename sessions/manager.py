"""SessionManager: open, look up, fork, detach, expire and close sessions; run one-shot requests.

No sockets and no torch: web/ hands it plain parameters and a sink for events; the engine
thread does every piece of device work. Limits: `max_sessions` live sessions (detached ones
count until their TTL, but an `open` at the limit closes the longest-detached one, so only
attached sessions can fill the server), the engine's own KV budget, and for realtime sessions the
measured chunk rate (sessions/capacity.py); each answers `busy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from models.actions import FrameAction
from models.registry import UnknownModelError
from models.world import Conditioning, ConditioningError
from runtime.engine import EngineThread, StreamInfo
from runtime.errors import CapacityError, EngineDeadError, StreamNotFound
from runtime.memory import OutOfBudget
from runtime.requests import DebugHooks
from sessions import capacity
from sessions.errors import InvalidInput, SessionBusy, SessionError, SessionFailed, SessionNotFound
from sessions.events import ClosedEvent, DoneEvent, ErrorEvent, FramesEvent, ReadyEvent, SessionEvent
from sessions.session import Mode, Session, SessionStatus, Sink

log = logging.getLogger(__name__)
T = TypeVar("T")

ONESHOT_IN_FLIGHT = 4  # one-shot chunks queued at once: keeps the engine fed, never floods its queue


@dataclass(frozen=True)
class OpenParams:
    """What a client asks for when it opens a session (already schema-checked by web/)."""

    model: str | None = None  # None: the server's default model
    seed: int | None = None  # None: a random seed
    prompt: str | None = None  # only for worlds with text_prompts and a prompt source
    image: np.ndarray | None = None  # (H, W, 3) uint8 start frame
    mode: Mode = "realtime"
    max_ahead: int = 2  # realtime credits: chunks generated past the last ack
    debug: DebugHooks | None = None  # test hooks; refused unless the server allows them


class SessionManager:
    """All sessions of one server process."""

    def __init__(
        self,
        engine: EngineThread,
        *,
        default_model: str,
        max_sessions: int = 16,
        detach_ttl_s: float = 60.0,
        allow_debug_hooks: bool = False,
        realtime_headroom: float | None = None,
    ) -> None:
        """`realtime_headroom`: share of the measured chunk rate realtime admission keeps free
        (sessions/capacity.py); None: realtime opens are never refused for lack of chunk rate."""
        self.engine = engine
        self.default_model = default_model
        self.max_sessions = max_sessions
        self.detach_ttl_s = detach_ttl_s
        self.allow_debug_hooks = allow_debug_hooks
        self.realtime_headroom = capacity.check_headroom(realtime_headroom)
        self._sessions: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._sweeper: asyncio.Task | None = None

    # -- lookup ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session:
        """A live session by id."""
        s = self._sessions.get(session_id)
        if s is None:
            raise SessionNotFound(f"no session {session_id}")
        return s

    def by_token(self, token: str) -> Session:
        """A live session by resume token (compared in constant time per candidate)."""
        for known, s in self._by_token.items():
            if secrets.compare_digest(known, token):
                return s
        raise SessionNotFound("unknown or expired resume token")

    def models(self) -> dict[str, object]:
        """Specs of the loaded models by id."""
        return dict(self.engine.specs())

    # -- open / fork / close --------------------------------------------------------------------

    def _check_prompt(self, model_id: str, prompt: str | None) -> None:
        """invalid_field for a prompt the world cannot take (no text, unknown prompt); reads no tensor."""
        if prompt:
            problem = self.engine.prompt_problem(model_id, prompt)
            if problem is not None:
                raise InvalidInput(problem, field="prompt")

    async def _prepare_prompt(self, model_id: str, prompt: str | None) -> None:
        """Encode a checked prompt off the loop and the engine thread (a world with a text
        encoder; instant otherwise), so building the world only reads the encoded prompt."""
        if prompt:
            await self._engine_call(lambda: self.engine.prepare_prompt(model_id, prompt))

    def _conditioning(self, model_id: str, p: OpenParams) -> Conditioning:
        self._check_prompt(model_id, p.prompt)
        seed = p.seed if p.seed is not None else secrets.randbelow(2**31)
        return Conditioning(seed=seed, image=p.image, prompt=p.prompt or None)

    def _new(self, model_id: str, mode: Mode, max_ahead: int, cond: Conditioning) -> Session:
        session = Session(
            self.engine,
            session_id=uuid.uuid4().hex,
            resume_token=secrets.token_urlsafe(32),  # 256 bits
            spec=self.engine.specs()[model_id],
            mode=mode,
            max_ahead=max_ahead,
            cond=cond,
        )
        session.on_finished = self._forget
        return session

    async def open(self, params: OpenParams) -> Session:
        """Create a session and its world. Raises SessionBusy / SessionNotFound / InvalidInput."""
        model_id = params.model or self.default_model
        specs = self.engine.specs()
        if model_id not in specs:
            raise SessionNotFound(f"unknown model {model_id!r}; loaded: {sorted(specs)}")
        if params.debug is not None and not self.allow_debug_hooks:
            raise InvalidInput(
                "debug hooks are off on this server (start it with --debug-hooks)", field="debug"
            )
        if params.mode == "realtime":
            self._check_realtime_rate(model_id)
        if len(self._sessions) >= self.max_sessions and not self._evict_detached():
            raise SessionBusy(f"server is full ({self.max_sessions} sessions); retry later")
        cond = self._conditioning(model_id, params)
        await self._prepare_prompt(model_id, cond.prompt)
        session = self._new(model_id, params.mode, params.max_ahead, cond)
        self._sessions[session.id] = session  # counts against the limit while the world is built
        try:
            info = await self._add_stream(session, model_id, cond, params.debug)
        except BaseException:
            self._sessions.pop(session.id, None)
            raise
        session.frame = info.frame
        session.frames_out = info.video_frames
        self._by_token[session.resume_token] = session
        self._ensure_sweeper()
        return session

    async def _add_stream(
        self, session: Session, model_id: str, cond: Conditioning, debug: DebugHooks | None
    ) -> StreamInfo:
        """The session's engine stream. While its bytes do not fit the device budget, detached
        sessions give way, the longest-detached first, as they do at the session count."""
        while True:
            try:
                return await self._engine_call(
                    lambda: self.engine.add_stream(session.id, model_id, cond, debug)
                )
            except SessionBusy as exc:
                # The eviction's remove reaches the engine before the next add (calls run in order).
                if not isinstance(exc.__cause__, OutOfBudget) or not self._evict_detached():
                    raise

    async def fork(self, src: Session) -> Session:
        """Copy `src`'s committed world into a new, detached session (attach with its token)."""
        src._check_live()
        if len(self._sessions) >= self.max_sessions:
            raise SessionBusy(f"server is full ({self.max_sessions} sessions); retry later")
        dst = self._new(src.spec.id, src.mode, src.max_ahead, src.cond)
        self._sessions[dst.id] = dst
        try:
            info: StreamInfo = await self._engine_call(lambda: self.engine.fork_stream(src.id, dst.id))
        except BaseException:
            self._sessions.pop(dst.id, None)
            raise
        dst.forked_from(src, info)
        self._by_token[dst.resume_token] = dst
        return dst

    def _check_realtime_rate(self, model_id: str) -> None:
        """SessionBusy when the measured chunk rate cannot serve one more realtime session of
        `model_id` beside the realtime sessions that are attached or opening (detached ones
        generate nothing; a resume is not refused)."""
        need: defaultdict[str, float] = defaultdict(float)
        for s in self._sessions.values():
            if s.mode == "realtime" and s.status in (SessionStatus.OPENING, SessionStatus.ACTIVE):
                need[s.spec.id] += capacity.chunks_per_s(s.spec)
        if not need:
            return  # the only realtime session gets what the device gives, even below its fps
        need[model_id] += capacity.chunks_per_s(self.engine.specs()[model_id])
        rates = {m: self.engine.rate(m) for m in need}
        reason = capacity.refusal(self.realtime_headroom, need, rates, model_id)
        if reason is not None:
            raise SessionBusy(reason)

    def _evict_detached(self) -> bool:
        """Close the session detached the longest (its token dies: `not_found`) to make room for
        an active client; False when every session is attached."""
        detached = [s for s in self._sessions.values() if s.status is SessionStatus.DETACHED]
        if not detached:
            return False
        oldest = min(detached, key=lambda s: s.detached_at or 0.0)
        log.info("= session %s evicted (detached, server full)", oldest.id)
        oldest.finish(SessionStatus.EXPIRED)  # frees its engine stream before the new one is added
        return True

    async def close(self, session: Session, status: SessionStatus = SessionStatus.CLOSED) -> None:
        """End a session and free its world."""
        session.finish(status)  # calls _forget

    def _forget(self, session: Session) -> None:
        self._sessions.pop(session.id, None)
        self._by_token.pop(session.resume_token, None)
        self.engine.cancel_stream(session.id)
        with contextlib.suppress(EngineDeadError, CapacityError):
            fut = self.engine.remove_stream(session.id)
            fut.add_done_callback(_ignore_result)

    async def _engine_call(self, call: Callable[[], Awaitable[T]]) -> T:
        """Await an engine call (made inside, so its synchronous refusals map the same way)."""
        try:
            return await call()
        except CapacityError as exc:
            raise SessionBusy(str(exc)) from exc
        except UnknownModelError as exc:
            raise SessionNotFound(str(exc)) from exc
        except ConditioningError as exc:
            raise InvalidInput(str(exc), field=exc.field) from exc
        except StreamNotFound as exc:
            raise SessionNotFound(str(exc)) from exc
        except EngineDeadError as exc:
            raise SessionFailed(str(exc)) from exc

    async def reset(self, session: Session, seq: int, seed: int | None, prompt: str | None = None) -> None:
        """A fresh world in `session` (a new seed / prompt, or the current ones)."""
        self._check_prompt(session.spec.id, prompt)
        cond = Conditioning(
            seed=session.cond.seed if seed is None else seed,
            image=session.cond.image,
            prompt=prompt or session.cond.prompt,
        )
        await self._prepare_prompt(session.spec.id, cond.prompt)
        await session.reset(seq, cond)

    async def switch_prompt(self, session: Session, seq: int, text: str) -> None:
        """A `prompt` switch: checked (invalid_field `text` for a world without prompts or a
        prompt it cannot take; the session goes on), encoded off the loop and the engine thread,
        then handed to the session for its next chunk."""
        session._check_live()
        if not session.spec.prompts:
            raise InvalidInput(f"model {session.spec.id} takes no prompt", field="text")
        problem = self.engine.prompt_problem(session.spec.id, text) if text else "an empty prompt"
        if problem is not None:
            raise InvalidInput(problem, field="text")
        try:
            await self._prepare_prompt(session.spec.id, text)
        except InvalidInput as exc:  # the encoder refused it: name the message's field
            raise InvalidInput(str(exc), field="text") from exc
        session.switch_prompt(seq, text)

    # -- one-shot -------------------------------------------------------------------------------

    async def generate(
        self,
        params: OpenParams,
        actions: Sequence[Sequence[FrameAction]],
        chunks: int,
        sink: Sink,
        room: Callable[[], Awaitable[None]] | None = None,
    ) -> DoneEvent:
        """Run `chunks` chunks with scripted actions (one list per chunk, like `step.actions`;
        chunks past the end get no input) through the same loop, streaming frames to `sink`.

        `room`, if given, is awaited before each chunk is asked for: the consumer's backpressure
        (a one-shot has no acks, so without it a slow consumer would have to buffer every chunk)."""
        if len(actions) > chunks:
            raise InvalidInput(f"{len(actions)} action lists for {chunks} chunks", field="actions")
        session = await self.open(replace(params, mode="lockstep"))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        window = asyncio.Semaphore(ONESHOT_IN_FLIGHT)
        total = {"chunks": 0, "frames": 0}

        def on_event(ev: SessionEvent) -> None:
            if isinstance(ev, ClosedEvent):
                return  # the one-shot's own close; `done` goes out first
            sink(ev)
            if isinstance(ev, FramesEvent):
                total["chunks"] += 1
                total["frames"] += ev.frames.shape[0]
                session.ack(ev.chunk)  # one-shot clients do not ack; nothing needs retaining
                window.release()
                if total["chunks"] == chunks and not done.done():
                    done.set_result(None)
            elif isinstance(ev, ErrorEvent) and not done.done():
                done.set_exception(SessionFailed(ev.message) if ev.fatal else SessionError(ev.message))
                window.release()  # wake the submit loop so it sees `done`

        ok = False
        try:
            session.activate(on_event)
            sink(ReadyEvent(0, session.frame))
            for i in range(chunks):
                if room is not None:
                    await room()
                await window.acquire()
                if done.done():
                    break
                session.step(i, list(actions[i]) if i < len(actions) else [])
            await done
            ok = True
            return DoneEvent(total["chunks"], total["frames"], dict(session.totals.ms))
        finally:
            await self.close(session, SessionStatus.DONE if ok else SessionStatus.CLOSED)

    # -- detach TTL -----------------------------------------------------------------------------

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while self._sessions:
            await asyncio.sleep(min(1.0, self.detach_ttl_s / 4))
            self.expire_detached()

    def expire_detached(self, now: float | None = None) -> list[str]:
        """Close sessions detached for longer than the TTL; returns their ids."""
        now = time.monotonic() if now is None else now
        gone = [
            s
            for s in self._sessions.values()
            if s.status is SessionStatus.DETACHED
            and s.detached_at is not None
            and now - s.detached_at > self.detach_ttl_s
        ]
        for s in gone:
            s.finish(SessionStatus.EXPIRED)
        return [s.id for s in gone]

    async def shutdown(self) -> None:
        """Close every session (server stopping)."""
        for s in list(self._sessions.values()):
            s.finish(SessionStatus.SHUTDOWN)
        if self._sweeper is not None:
            self._sweeper.cancel()


def _ignore_result(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("remove_stream: %s", fut.exception())

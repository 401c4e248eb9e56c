"""A session: one client's world, its mode, input, flow control and delivery of committed chunks.

Lifecycle (`SessionStatus`, ordered so that `is_finished` is one comparison)::

    OPENING -> ACTIVE <-> DETACHED -> CLOSED | EXPIRED | DONE | FAILED | SHUTDOWN | IDLE

realtime  the session keeps chunks coming while it is ACTIVE, not paused, and has credits:
          chunks in flight + committed-but-unacked chunks < max_ahead. Each chunk reads the
          action buffer when it begins (latest keys win, mouse deltas add up).
lockstep  one chunk per `step`, with the given per-frame actions.

Committed chunks are delivered to the attached sink and retained until acked (bounded: the
oldest go first), so a client that reattaches after a dropped socket gets every chunk it has
not acked. Chunk numbers never repeat within a session, also across `reset`, except after a
`rewind` to chunk N: the chunks after N are gone and their numbers are generated again.

Runs on the asyncio event loop; all model work goes through the `EngineThread`.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from models.actions import FrameAction
from models.world import Conditioning, ConditioningError, ModelSpec
from runtime.engine import EngineThread, StreamInfo
from runtime.errors import CapacityError, EngineDeadError, InvalidRequest, StreamNotFound
from runtime.errors import NotRetained as EngineNotRetained
from runtime.requests import ChunkCancelled, ChunkCommitted, ChunkFailed, ChunkRequest, Outcome
from sessions.actions import ActionBuffer, ChunkSource
from sessions.errors import (
    InvalidInput,
    NotRetained,
    RateLimited,
    SessionBusy,
    SessionFailed,
    SessionNotFound,
)
from sessions.events import (
    CancelledEvent,
    ClosedEvent,
    ErrorEvent,
    FramesEvent,
    ReadyEvent,
    SessionEvent,
)

log = logging.getLogger(__name__)

Mode = Literal["realtime", "lockstep"]
Sink = Callable[[SessionEvent], None]


def token_hash(token: str) -> str:
    """What the server keeps of a resume token to find its session (on disk too): its sha256."""
    return hashlib.sha256(token.encode()).hexdigest()


PIPELINE = 2  # realtime chunks queued in the engine at once, so the device never idles between chunks
MAX_STEPS_QUEUED = 8  # lockstep steps outstanding before `rate_limited`


MAX_CODEC_NAME = 32  # a snapshot's codec name longer than this is not kept


class SessionStatus(enum.IntEnum):
    """Where a session is in its life. Values >= CLOSED are finished."""

    OPENING = 0
    ACTIVE = 1  # a client is attached
    DETACHED = 2  # no client; the world waits for a resume until the detach TTL
    CLOSED = 10  # the client closed it
    EXPIRED = 11  # detached past the TTL
    DONE = 12  # a one-shot run finished
    FAILED = 13  # the engine failed
    SHUTDOWN = 14  # the server stopped
    IDLE = 15  # its client sent nothing for the server's idle timeout

    @property
    def is_finished(self) -> bool:
        """True for every terminal status."""
        return self >= SessionStatus.CLOSED


# The `closed.reason` a client sees for each terminal status.
FINISHED_REASON = {
    SessionStatus.CLOSED: "closed",
    SessionStatus.EXPIRED: "expired",
    SessionStatus.DONE: "done",
    SessionStatus.FAILED: "error",
    SessionStatus.SHUTDOWN: "shutdown",
    SessionStatus.IDLE: "idle",
}


@dataclass
class _Pending:
    """A chunk request this session has in the engine."""

    kind: Literal["realtime", "step"]
    seq: int | None  # client seq of the step (lockstep) or None
    source: ChunkSource | None  # realtime action source (knows the action seq applied)
    prompt: tuple[int, str] | None = None  # (seq, text) of the `prompt` switch the chunk carries


@dataclass
class _CancelWait:
    """A `cancel` (or the cancel a `reset` makes) waiting for the chunks that were outstanding
    when it came."""

    seq: int  # the cancel's (or reset's) seq
    waiting: set[int]  # request ids not yet resolved
    first: int | None = None  # the smallest chunk number cancelled so far
    answered: asyncio.Future[None] | None = None  # set once its `cancelled` went out (reset waits on it)
    prompt_seq: int | None = None  # a prompt switch one of the cancelled chunks carried


@dataclass
class _Totals:
    """Per-stage milliseconds summed over a session's chunks (for one-shot `done`)."""

    ms: dict[str, float] = field(default_factory=dict)

    def add(self, timings: dict[str, float]) -> None:
        for k, v in timings.items():
            self.ms[k] = round(self.ms.get(k, 0.0) + v, 3)


class Session:
    """One client's world. Created by `SessionManager`; mutate only through its methods."""

    def __init__(
        self,
        engine: EngineThread,
        session_id: str,
        resume_token: str,
        spec: ModelSpec,
        mode: Mode,
        max_ahead: int,
        cond: Conditioning,
    ) -> None:
        self._et = engine
        self.id = session_id
        self.resume_token = resume_token  # "" for a restored session until its client resumes
        self.token_hash = token_hash(resume_token) if resume_token else ""
        self.spec = spec
        self.mode: Mode = mode
        self.max_ahead = max_ahead
        self.cond = cond  # what the current world started from (reset may change seed)
        # The codec its client last attached with (set by the serving layer; opaque here): kept in
        # snapshots, so a resume naming none gets it back after a restart or a move.
        self.codec: str | None = None
        self.status = SessionStatus.OPENING
        self.paused = False
        self.detached_at: float | None = None
        self.buffer = ActionBuffer()
        self.last_chunk = 0  # last committed chunk number (session numbering)
        self.acked = 0  # highest chunk the client acked
        self.frames_out = 0  # frames committed so far (frame0 of the next chunk)
        self.frame: np.ndarray | None = None  # (H, W, 3) uint8 latest committed frame (start frame first)
        self._chunk_base = 0  # session chunk = base + engine chunk (resets restart the engine count)
        self._high = 0  # the highest chunk of the current world (a rewind's retention counts from it)
        # No rewind reaches before this chunk: the engine keeps no history from before a prompt
        # switch (the world moved to another row and prompt) or a restore. Mirrored here, not
        # asked of the engine, so a rewind is refused or cancels what is outstanding at once.
        self._floor = 0
        self._frame_base = 0
        self._resetting = False  # a reset or rewind is between its cancel and its `ready`: nothing new starts
        self._holds = 0  # snapshots in progress (`hold`): nothing new starts
        self._deferring = 0  # ... of them checkpoints, which keep lockstep steps for after
        self._deferred: list[tuple[int, list[FrameAction]]] = []  # steps kept by a checkpoint
        self._quiet: list[asyncio.Future[None]] = []  # `hold`s waiting for the outstanding chunks
        self._pending: dict[int, _Pending] = {}
        self._cancels: list[_CancelWait] = []  # cancels waiting for their chunks to resolve
        # A `prompt` switch (seq, text) waiting for the next chunk submitted: one at most, the
        # latest wins (see `switch_prompt`).
        self._prompt_next: tuple[int, str] | None = None
        # Unacked chunks kept for a resume. Realtime never has more than max_ahead unacked; in
        # lockstep at most MAX_STEPS_QUEUED chunks can commit while nobody listens, so those are
        # always kept, and older unacked ones (already delivered) go first.
        self._retained: deque[FramesEvent] = deque(maxlen=max(max_ahead, MAX_STEPS_QUEUED) + PIPELINE)
        self._sink: Sink | None = None
        self._events: list[tuple[float, str]] = []  # lifecycle events, drained by take_events()
        self.totals = _Totals()
        self.on_finished: Callable[[Session], None] | None = None  # set by the manager
        self.keep = True  # saved on stop (`SessionManager.persist`); a one-shot is not

    # -- lifecycle ------------------------------------------------------------------------------

    def _set_status(self, status: SessionStatus) -> None:
        if status == self.status:
            return
        log.debug("= session %s: %s -> %s", self.id, self.status.name, status.name)
        self.record_event(f"{self.status.name}->{status.name}")
        self.status = status

    def record_event(self, what: str) -> None:
        """Note a lifecycle event (bounded: the newest 64 are kept)."""
        self._events.append((time.time(), what))
        del self._events[:-64]

    def take_events(self) -> list[tuple[float, str]]:
        """Drain recorded lifecycle events."""
        events, self._events = self._events, []
        return events

    def _check_live(self) -> None:
        if self.status.is_finished:
            raise SessionNotFound(f"session {self.id} is {self.status.name.lower()}")

    @property
    def world_base(self) -> int:
        """The session chunk number before the current world's chunk 1 (0 until a reset)."""
        return self._chunk_base

    async def action_log(self) -> tuple[int, list[list[FrameAction]]]:
        """The current world's action log, kept by the engine with the world itself (a rewind cuts
        it, a reset restarts it, a fork copies it, a snapshot saves it): the session chunk number
        of its first chunk and each logged chunk's per-frame actions, oldest first. Chunks
        dropped from its front (the engine keeps a bounded number) are the ones before that."""
        committed, chunks = await self._et.action_log(self.id)
        return self._chunk_base + committed - len(chunks) + 1, chunks

    @property
    def outstanding(self) -> int:
        """Chunks submitted and not yet resolved."""
        return len(self._pending)

    def activate(self, sink: Sink) -> list[FramesEvent]:
        """Attach a client (open or resume). Returns unacked chunks to resend, oldest first."""
        self._check_live()
        self._sink = sink
        self.detached_at = None
        self._set_status(SessionStatus.ACTIVE)
        resend = [
            FramesEvent(**{**ev.__dict__, "resent": True}) for ev in self._retained if ev.chunk > self.acked
        ]
        self._pump()
        return resend

    def forked_from(self, src: Session, info: StreamInfo) -> None:
        """This new session holds a copy of `src`'s committed world (`info`: the engine's fork):
        its numbering continues `src`'s from there, its frame is `src`'s, and it starts detached
        (a client attaches with its token)."""
        self._chunk_base = src._chunk_base
        self._frame_base = src._frame_base
        self.last_chunk = self.acked = src._chunk_base + info.chunks
        self._high = max(src._high, self.last_chunk)  # the copied row holds the same ring
        self._floor = src._floor
        self.frames_out = src._frame_base + info.video_frames
        self.frame = src.frame
        self.detach()

    def detach(self) -> None:
        """The client's socket went away: keep the world, stop generating."""
        if self.status.is_finished:
            return
        self._sink = None
        self.detached_at = time.monotonic()
        self._set_status(SessionStatus.DETACHED)

    def finish(self, status: SessionStatus) -> None:
        """Mark finished (the manager frees the engine stream) and tell the client why. `closed`
        answers every outstanding chunk (none commits for the client after it); a cancel or reset
        still waiting for its chunks first gets its `cancelled`: nothing after the last commit."""
        if self.status.is_finished:
            return
        self._set_status(status)
        for wait in self._cancels:
            self._answer(wait, self.last_chunk + 1)
        self._cancels.clear()
        self._wake_holds()
        self._emit(ClosedEvent(FINISHED_REASON[status]))
        self._sink = None
        if self.on_finished is not None:
            self.on_finished(self)

    def _emit(self, event: SessionEvent) -> None:
        if self._sink is not None:
            self._sink(event)

    # -- client input ---------------------------------------------------------------------------

    def _validate(self, action: FrameAction) -> None:
        problem = self.spec.action_space.problem(action)
        if problem is not None:
            raise InvalidInput(problem[1], field=problem[0])

    def act(
        self, seq: int, keys: Sequence[str], mouse: tuple[float, float], vector: Sequence[float] | None
    ) -> None:
        """Realtime input; applied at the next chunk boundary."""
        self._check_live()
        if self.mode != "realtime":
            raise InvalidInput(
                "`action` is for realtime sessions; lockstep sessions send `step`", field="type"
            )
        action = FrameAction(
            frozenset(keys),
            (float(mouse[0]), float(mouse[1])),
            None if vector is None else tuple(float(v) for v in vector),
        )
        self._validate(action)
        self.buffer.push(seq, action.keys, action.mouse, action.vector)

    def step(self, seq: int, actions: Sequence[FrameAction]) -> None:
        """Lockstep: generate exactly one chunk with these actions (one per frame, or one for all)."""
        self._check_live()
        if self.mode != "lockstep":
            raise InvalidInput(
                "`step` is for lockstep sessions; realtime sessions send `action`", field="type"
            )
        for a in actions:
            self._validate(a)
        if self._resetting:  # only another connection that resumed the session can get here
            raise RateLimited("a reset or rewind is in progress; send the step after its `ready`")
        if self._holds and not self._deferring:
            raise RateLimited("a snapshot is being taken; send the step after `saved`")
        if sum(p.kind == "step" for p in self._pending.values()) + len(self._deferred) >= MAX_STEPS_QUEUED:
            raise RateLimited(f"{MAX_STEPS_QUEUED} steps already outstanding")
        if self._holds:
            self._deferred.append((seq, list(actions)))  # a checkpoint: runs once it is taken
            return
        self._submit("step", seq=seq, actions=list(actions))

    def ack(self, chunk: int) -> None:
        """The client has shown `chunk`: release retained chunks and give a credit back."""
        self._check_live()
        if chunk > self.last_chunk:
            if chunk <= self._high:
                return  # a chunk a rewind discarded, shown before the client heard of the rewind
            raise InvalidInput(f"chunk {chunk} has not been sent (last is {self.last_chunk})", field="chunk")
        if chunk > self.acked:
            self.acked = chunk
            while self._retained and self._retained[0].chunk <= chunk:
                self._retained.popleft()
        self._pump()

    def pause(self) -> None:
        """Stop starting realtime chunks (the one in flight still commits)."""
        self._check_live()
        self.paused = True

    def resume(self) -> None:
        """Start realtime chunks again."""
        self._check_live()
        self.paused = False
        self._pump()

    def cancel(self, seq: int) -> None:
        """Abort every chunk in flight or queued; answered by `cancelled` once they rolled back."""
        self._check_live()
        self._et.cancel_stream(self.id)
        # `_pending`, not what the engine still holds: an outcome already on its way (a commit
        # too) is waited for, so `cancelled` never names a chunk whose frames come after it.
        if not self._pending:
            self._emit(CancelledEvent(seq, self.last_chunk + 1))
        else:
            self._cancels.append(_CancelWait(seq, set(self._pending)))

    async def reset(self, seq: int, cond: Conditioning) -> None:
        """A fresh world in this session. Answered by `ready` naming the last old chunk; chunks
        outstanding when it came are cancelled first, exactly as a `cancel` with the reset's seq:
        their `frames` (chunks that committed before the cancel took), then one `cancelled`, then
        `ready`. If the new world cannot be built the old one stays (no `ready`), and the
        cancel still happens."""
        self._check_live()
        wait: _CancelWait | None = None
        self._et.cancel_stream(self.id)
        if self._pending:  # as `cancel` counts them
            loop = asyncio.get_running_loop()
            wait = _CancelWait(seq, set(self._pending), answered=loop.create_future())
            self._cancels.append(wait)
        self._resetting = True
        self._prompt_next = None  # the new world starts from its own prompt
        try:
            try:
                info = await self._et.reset_stream(self.id, cond)
            except (StreamNotFound, EngineDeadError) as exc:
                if self.status.is_finished:
                    return  # the session ended meanwhile: `closed` answered the reset
                raise SessionFailed(f"reset failed: {exc}") from exc
            except CapacityError as exc:  # too many opens/resets being conditioned: the old world stays
                raise SessionBusy(str(exc)) from exc
            except ConditioningError as exc:
                raise InvalidInput(str(exc), field=exc.field) from exc
            if wait is not None:
                # The old world's outcomes, numbered in it; the last may come with the engine's
                # next step. The session finishing answers the wait too.
                await wait.answered
        finally:
            self._resetting = False
        if self.status.is_finished:
            return  # `closed` went out instead of `ready`
        self.cond = cond
        self.frame = info.frame
        self._chunk_base = self._high = self.last_chunk
        self._frame_base = self.frames_out  # the new world's frame 0 (its start frame, if any)
        self.frames_out += info.video_frames
        self.acked = self.last_chunk
        self._retained.clear()
        self.buffer.clear()
        self._emit(ReadyEvent(self.last_chunk, self.frame))
        self._pump()

    async def rewind(self, seq: int, chunk: int) -> None:
        """Roll the world back to the end of chunk `chunk` (within the engine's retention).
        Answered by `ready` naming `chunk`, with its last frame; the next chunk is `chunk` + 1.
        Chunks outstanding when it came are cancelled first, exactly as by a reset: the ones that
        committed before the cancel took come as `frames`, then one `cancelled` with the
        rewind's seq, then `ready`. `NotRetained` when the world no longer holds that chunk
        (beyond the retention, counted from the highest chunk of this world, or before the last
        reset): found here before anything is cancelled; only should the chunks that commit
        meanwhile push it out of the retention does the engine refuse after the cancel, as a
        reset whose new world cannot be built."""
        self._check_live()
        if self._resetting:
            raise RateLimited("a reset or rewind is in progress; send the rewind after its `ready`")
        if chunk > self.last_chunk:
            raise InvalidInput(f"chunk {chunk} has not been sent (last is {self.last_chunk})", field="chunk")
        oldest = max(self._chunk_base, self._floor, self._high - self._et.retention)
        if chunk < oldest:
            raise NotRetained(self._not_retained(chunk, oldest))
        wait: _CancelWait | None = None
        self._et.cancel_stream(self.id)
        if self._pending:  # as `cancel` counts them
            wait = _CancelWait(seq, set(self._pending), answered=asyncio.get_running_loop().create_future())
            self._cancels.append(wait)
        self._resetting = True
        try:
            try:
                info = await self._et.rewind_stream(self.id, chunk - self._chunk_base)
            except EngineNotRetained as exc:
                raise NotRetained(self._not_retained(chunk, self._chunk_base + exc.oldest)) from exc
            except (StreamNotFound, EngineDeadError) as exc:
                if self.status.is_finished:
                    return  # the session ended meanwhile: `closed` answered the rewind
                raise SessionFailed(f"rewind failed: {exc}") from exc
            if wait is not None:
                await wait.answered  # the outcomes numbered before the rewind come first
        finally:
            self._resetting = False
        if self.status.is_finished:
            return  # `closed` went out instead of `ready`
        self.last_chunk = self.acked = chunk
        self.frames_out = self._frame_base + info.video_frames
        self.frame = info.frame
        self._retained.clear()
        self.buffer.clear()
        self._emit(ReadyEvent(chunk, self.frame))
        self._pump()

    def _not_retained(self, chunk: int, oldest: int) -> str:
        if chunk < self._chunk_base:
            return f"chunk {chunk} belongs to the world before the last reset (chunk {self._chunk_base})"
        return (
            f"chunk {chunk} is not retained: the earliest chunk this session can go back to is "
            f"{oldest} (the last is {self.last_chunk}; retention {self._et.retention} chunks)"
        )

    # -- prompt switches --------------------------------------------------------------------------

    def switch_prompt(self, seq: int, text: str) -> None:
        """Generate from the next chunk submitted on under `text` (already checked and encoded
        by the manager). That chunk's `frames` carry `prompt_seq` = `seq`; if it is cancelled or
        fails, the switch is dropped with it (the old prompt stays; a `cancelled` names it). A
        switch still waiting for its chunk is replaced by a newer one."""
        self._check_live()
        if self._resetting:
            raise RateLimited("a reset is in progress; send the prompt after its `ready`")
        self._prompt_next = (seq, text)
        self._pump()

    def _take_prompt(self) -> tuple[int, str] | None:
        """The waiting switch, for the chunk being submitted."""
        prompt, self._prompt_next = self._prompt_next, None
        return prompt

    def _prompt_committed(self, entry: _Pending) -> int | None:
        """The switch a committed chunk carried is now the session's prompt (a reset without
        `prompt` and a fork keep it); returns its seq."""
        if entry.prompt is None:
            return None
        self.cond = replace(self.cond, prompt=entry.prompt[1], text=None)
        return entry.prompt[0]

    # -- engine traffic -------------------------------------------------------------------------

    def _pump(self) -> None:
        """Keep realtime chunks coming while allowed."""
        if (
            self.mode != "realtime"
            or self.status is not SessionStatus.ACTIVE
            or self.paused
            or self._resetting
            or self._holds
        ):
            return
        while (
            len(self._pending) < PIPELINE
            and len(self._pending) + self.last_chunk - self.acked < self.max_ahead
        ):
            self._submit("realtime")

    def _submit(
        self,
        kind: Literal["realtime", "step"],
        seq: int | None = None,
        actions: list[FrameAction] | None = None,
    ) -> None:
        rid = self._et.new_request_id()
        source = ChunkSource(self.buffer) if kind == "realtime" else None
        prompt = self._take_prompt()
        request = ChunkRequest(
            self.id,
            rid,
            actions=actions,
            source=source,
            prompt=None if prompt is None else prompt[1],
            submitted_at=time.perf_counter(),
        )
        try:
            fut = self._et.submit(request)
        except CapacityError as exc:
            self._prompt_next = self._prompt_next or prompt  # not submitted: still waiting
            raise RateLimited(str(exc)) from exc
        except EngineDeadError as exc:
            self.finish(SessionStatus.FAILED)
            raise SessionFailed(str(exc)) from exc
        self._pending[rid] = _Pending(kind, seq, source, prompt)
        fut.add_done_callback(lambda f, rid=rid: self._on_outcome(rid, f))

    def _on_outcome(self, rid: int, fut: asyncio.Future[Outcome]) -> None:
        entry = self._pending.pop(rid)
        if not self._pending:
            self._wake_holds()
        try:
            outcome = fut.result()
        except EngineDeadError as exc:
            self._emit(ErrorEvent("internal", f"engine failed: {exc}", entry.seq, fatal=True))
            self.finish(SessionStatus.FAILED)
            return
        except InvalidRequest as exc:
            self._emit(ErrorEvent("invalid_field", f"{exc.field}: {exc}", entry.seq))
            outcome = None
        except CapacityError as exc:
            self._emit(ErrorEvent("rate_limited", str(exc), entry.seq))
            outcome = None
        except StreamNotFound:
            outcome = None  # the session closed while the chunk was queued
        if self.status.is_finished:
            return  # `closed` answered it
        if outcome is not None:
            self._handle(outcome, entry)
        self._resolve_cancels(rid, outcome, entry)
        self._pump()

    def _resolve_cancels(self, rid: int, outcome: Outcome | None, entry: _Pending | None = None) -> None:
        """A cancel is answered once every chunk outstanding when it came has resolved, naming
        the first chunk that did not commit. Outcomes may arrive in any order (a queued chunk's
        cancel can come before the running one's), so the smallest cancelled chunk wins; chunks
        commit in order, so with none cancelled it is the one after the last commit."""
        for wait in list(self._cancels):
            if rid not in wait.waiting:
                continue
            wait.waiting.discard(rid)
            if isinstance(outcome, ChunkCancelled):
                chunk = self._chunk_base + outcome.chunk
                wait.first = chunk if wait.first is None else min(wait.first, chunk)
                if entry is not None and entry.prompt is not None:
                    wait.prompt_seq = entry.prompt[0]
            if not wait.waiting:
                self._cancels.remove(wait)
                self._answer(wait, wait.first or self.last_chunk + 1)

    def _answer(self, wait: _CancelWait, chunk: int) -> None:
        self._emit(CancelledEvent(wait.seq, chunk, wait.prompt_seq))
        if wait.answered is not None and not wait.answered.done():
            wait.answered.set_result(None)

    def _handle(self, outcome: Outcome, entry: _Pending) -> None:
        if isinstance(outcome, ChunkCommitted):
            action_seq = (
                entry.source.seq if entry.source is not None else (entry.seq if entry.seq is not None else -1)
            )
            event = FramesEvent(
                chunk=self._chunk_base + outcome.chunk,
                frame0=self._frame_base + outcome.frame0,
                frames=outcome.frames,
                action_seq=action_seq,
                timings=outcome.timings.as_dict(),
                prompt_seq=self._prompt_committed(entry),
            )
            self.last_chunk = event.chunk
            self._high = max(self._high, event.chunk)
            if event.prompt_seq is not None:
                self._floor = event.chunk
            self.frames_out = event.frame0 + event.frames.shape[0]
            self.frame = event.frames[-1]
            self.totals.add(event.timings)
            self._retained.append(event)
            self._emit(event)
        elif isinstance(outcome, ChunkFailed):
            self._emit(
                ErrorEvent(
                    "internal",
                    f"chunk {self._chunk_base + outcome.chunk} failed and was rolled back: {outcome.message}",
                    entry.seq,
                )
            )

    # -- snapshots ------------------------------------------------------------------------------

    async def hold(self, cancel: bool = False, defer_steps: bool = False) -> None:
        """Start no new chunk until `unhold` and wait until none is outstanding, so the engine's
        committed world and this session's numbering agree (what a snapshot needs). `cancel`:
        abort the outstanding chunks instead of letting them commit (a `cancelled` still answers
        a waiting cancel or reset). Lockstep steps during a hold get `rate_limited`; with
        `defer_steps` (a cluster's periodic checkpoint, which its client does not know of) they
        wait, and start at the `unhold` that ends the last hold."""
        self._check_live()
        self._holds += 1
        self._deferring += defer_steps
        if cancel:
            self._et.cancel_stream(self.id)
        while self._pending and not self.status.is_finished:
            fut = asyncio.get_running_loop().create_future()
            self._quiet.append(fut)
            await fut

    def unhold(self, defer_steps: bool = False) -> None:
        """End a `hold` (`defer_steps` as it was held with): realtime chunks and the steps a
        checkpoint kept start again."""
        self._holds = max(0, self._holds - 1)
        self._deferring = max(0, self._deferring - defer_steps)
        if not self._holds and self._deferred and not self.status.is_finished:
            deferred, self._deferred = self._deferred, []
            for seq, actions in deferred:
                self._submit("step", seq=seq, actions=actions)
        self._pump()

    def _wake_holds(self) -> None:
        quiet, self._quiet = self._quiet, []
        for fut in quiet:
            if not fut.done():
                fut.set_result(None)

    def record(self) -> tuple[dict[str, object], dict[str, np.ndarray]]:
        """What this session keeps beside its engine stream, for a snapshot (during a `hold`):
        JSON (mode, numbering, conditioning, the retained chunks' numbers) and arrays (the start
        image, the latest frame, the retained chunks' frames). The resume token is not in it."""
        retained = list(self._retained)
        rec: dict[str, object] = {
            "model": self.spec.id,
            "mode": self.mode,
            "max_ahead": self.max_ahead,
            "seed": self.cond.seed,
            "prompt": self.cond.prompt,
            "chunk_base": self._chunk_base,
            "frame_base": self._frame_base,
            "last_chunk": self.last_chunk,
            "acked": self.acked,
            "frames_out": self.frames_out,
            "paused": self.paused,
            "codec": self.codec,
            "retained": [
                {"chunk": e.chunk, "frame0": e.frame0, "action_seq": e.action_seq, "timings": e.timings}
                for e in retained
            ],
        }
        arrays = {f"retained.{i}": e.frames for i, e in enumerate(retained)}
        if self.cond.image is not None:
            arrays["image"] = self.cond.image
        if self.frame is not None:
            arrays["frame"] = self.frame
        return rec, arrays

    def adopt(self, rec: dict, arrays: dict[str, np.ndarray], info: StreamInfo, keep_unacked: bool) -> None:
        """Take over a `record` for a session restored from a snapshot (`info`: its restored
        stream): its numbering, latest frame and, with `keep_unacked`, the retained chunks it
        still owes a resuming client (a save game opened as a new session owes none). It starts
        detached (attach with its token)."""
        self._chunk_base = int(rec["chunk_base"])
        self._frame_base = int(rec["frame_base"])
        self.last_chunk = self._high = self._floor = self._chunk_base + info.chunks
        self.frames_out = self._frame_base + info.video_frames
        self.frame = arrays.get("frame")
        self.paused = bool(rec.get("paused", False))
        codec = rec.get("codec")
        self.codec = codec if isinstance(codec, str) and len(codec) <= MAX_CODEC_NAME else None
        self.acked = self.last_chunk
        if keep_unacked:
            self.acked = min(int(rec["acked"]), self.last_chunk)
            for i, r in enumerate(rec.get("retained", [])):
                frames = arrays.get(f"retained.{i}")
                if frames is not None and self.acked < int(r["chunk"]) <= self.last_chunk:
                    self._retained.append(
                        FramesEvent(
                            int(r["chunk"]), int(r["frame0"]), frames, int(r["action_seq"]), r["timings"]
                        )
                    )
        self.detach()

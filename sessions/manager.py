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
from runtime.errors import CapacityError, EngineDeadError, InvalidRequest, StreamNotFound
from runtime.memory import OutOfBudget
from runtime.requests import DebugHooks
from runtime.snapshot import SnapshotError, read_manifest
from sessions import capacity
from sessions.errors import InvalidInput, SessionBusy, SessionError, SessionFailed, SessionNotFound
from sessions.events import ClosedEvent, DoneEvent, ErrorEvent, FramesEvent, ReadyEvent, SessionEvent
from sessions.session import Mode, Session, SessionStatus, Sink, token_hash
from sessions.store import StateStore, StoreError

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
        host_memory: int | None = None,
        spill: StateStore | None = None,
        new_token: Callable[[], str] | None = None,
    ) -> None:
        """`realtime_headroom`: share of the measured chunk rate realtime admission keeps free
        (sessions/capacity.py); None: realtime opens are never refused for lack of chunk rate.
        `host_memory`: bytes of host memory for offloaded sessions (None: no offload: a full
        device budget closes the longest-detached session); `spill`: where sessions past it go
        (None: the longest-offloaded one is closed instead). See "offload" below.
        `new_token`: makes each new session's resume token (None: 256 random bits; a cluster
        replica's tokens name it and are signed, web/cluster/tokens.py)."""
        self.engine = engine
        self.default_model = default_model
        self.max_sessions = max_sessions
        self.detach_ttl_s = detach_ttl_s
        self.allow_debug_hooks = allow_debug_hooks
        self.realtime_headroom = capacity.check_headroom(realtime_headroom)
        self._sessions: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._sweeper: asyncio.Task | None = None
        self.host_memory = host_memory
        self.spill = spill
        self.new_token = new_token or _random_token
        self._host: dict[str, bytes] = {}  # offloaded to host memory, the longest-offloaded first
        self._disk: set[str] = set()  # offloaded to `spill`
        self._moving: dict[str, asyncio.Future[None]] = {}  # sessions being offloaded now

    # -- lookup ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        """Every session, detached and offloaded ones included."""
        return list(self._sessions.values())

    def get(self, session_id: str) -> Session:
        """A live session by id."""
        s = self._sessions.get(session_id)
        if s is None:
            raise SessionNotFound(f"no session {session_id}")
        return s

    def by_token(self, token: str) -> Session:
        """A live session by resume token. Sessions are kept by the token's sha256 (a restored
        session's token exists only in its client), so a lookup reveals nothing about the tokens."""
        s = self._by_token.get(token_hash(token))
        if s is None:
            raise SessionNotFound("unknown or expired resume token")
        if not s.resume_token:
            s.resume_token = token  # a restored session learns its token back from its client
        return s

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
            resume_token=self.new_token(),
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
        self._by_token[session.token_hash] = session
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
                if not isinstance(exc.__cause__, OutOfBudget) or not await self._device_room():
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
        self._by_token[dst.token_hash] = dst
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
        self._drop_offloaded(session.id)
        self._sessions.pop(session.id, None)
        self._by_token.pop(session.token_hash, None)
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
        except InvalidRequest as exc:
            raise InvalidInput(f"{exc.field}: {exc}", field=exc.field) from exc
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

    # -- snapshots ------------------------------------------------------------------------------

    async def snapshot(self, session: Session) -> tuple[bytes, int]:
        """A save game of `session`: its whole state as snapshot bytes (runtime/snapshot.py) and
        the last chunk in it, taken once its outstanding chunks have resolved (they commit;
        realtime generation waits meanwhile). The resume token is not in it. The session goes on."""
        await session.hold()
        try:
            session._check_live()
            chunk = session.last_chunk
            return await self._snapshot_held(session), chunk
        finally:
            session.unhold()

    async def _snapshot_held(self, session: Session, token: str = "") -> bytes:
        rec, arrays = session.record()
        if token:
            rec["token_sha256"] = token
        return await self._engine_call(lambda: self.engine.snapshot_stream(session.id, rec, arrays))

    async def restore(self, data: bytes, mode: Mode | None = None, max_ahead: int | None = None) -> Session:
        """A new session from a save game (`snapshot` bytes): new id and token, numbered on from
        the saved chunk, detached until the caller activates it. `InvalidInput` (field "data")
        names why a snapshot is refused (damaged, another model or weights); `SessionBusy` as
        `open` when it does not fit."""
        if len(self._sessions) >= self.max_sessions and not self._evict_detached():
            raise SessionBusy(f"server is full ({self.max_sessions} sessions); retry later")
        return await self._restore(uuid.uuid4().hex, data, mode, max_ahead, None)

    async def _restore(
        self,
        session_id: str,
        data: bytes,
        mode: Mode | None,
        max_ahead: int | None,
        token: str | None,
        owes: bool | None = None,
    ) -> Session:
        """The stream from `data` under `session_id`, then its session. `token`: the saved token
        hash to keep (a restart); None: a new token (a save game). `owes`: whether it re-sends
        the unacked chunks in `data` (default: when it keeps its token)."""
        while True:
            try:
                info, rec, arrays = await self._engine_call(
                    lambda: self.engine.restore_stream(session_id, data)
                )
                break
            except SessionBusy as exc:
                if not isinstance(exc.__cause__, OutOfBudget) or not await self._device_room():
                    raise
            except SnapshotError as exc:
                raise InvalidInput(f"data: snapshot refused ({exc.reason}): {exc}", field="data") from exc
        problem = _record_problem(rec, self.engine.specs())
        if problem is not None:
            with contextlib.suppress(EngineDeadError, CapacityError):
                self.engine.remove_stream(session_id).add_done_callback(_ignore_result)
            raise InvalidInput(f"data: snapshot refused (damaged): {problem}", field="data")
        model_id = str(rec["model"])
        cond = Conditioning(seed=int(rec["seed"]), image=arrays.get("image"), prompt=rec.get("prompt"))
        session = Session(
            self.engine,
            session_id=session_id,
            resume_token="" if token else self.new_token(),
            spec=self.engine.specs()[model_id],
            mode=mode or rec["mode"],  # type: ignore[arg-type]
            max_ahead=max_ahead or int(rec["max_ahead"]),
            cond=cond,
        )
        if token:
            session.token_hash = token
        session.on_finished = self._forget
        session.adopt(rec, arrays, info, keep_unacked=token is not None if owes is None else owes)
        self._sessions[session.id] = session
        self._by_token[session.token_hash] = session
        self._ensure_sweeper()
        return session

    async def persist(self, store: StateStore, timeout_s: float) -> tuple[list[str], list[str]]:
        """Save every live and detached session to `store` within `timeout_s` (the server is
        stopping): chunks in flight are cancelled (a resuming client sends its unanswered steps
        again), then each session's snapshot is written, the longest-idle first. Returns (saved,
        not saved) session ids; those not saved in time, or whose snapshot failed, are logged."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        live = (SessionStatus.ACTIVE, SessionStatus.DETACHED)
        todo = [s for s in self._sessions.values() if s.status in live and s.keep]
        todo.sort(key=lambda s: (s.status is SessionStatus.ACTIVE, s.detached_at or 0.0))
        holds = [asyncio.ensure_future(s.hold(cancel=True)) for s in todo]
        saved: list[str] = []
        try:
            await asyncio.wait_for(
                asyncio.gather(*holds, return_exceptions=True), max(0.0, deadline - loop.time())
            )
            for s in todo:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    if s.id in self._disk and self.spill is not None and self.spill.root == store.root:
                        saved.append(s.id)  # already there
                        continue
                    data = self._host.get(s.id) or self._read_disk(s.id)
                    if data is None:
                        data = await asyncio.wait_for(self._snapshot_held(s, s.token_hash), left)
                    await loop.run_in_executor(None, store.write, s.id, data)
                    saved.append(s.id)
                except (SessionError, StoreError, OSError, TimeoutError) as exc:
                    log.warning("= session %s not saved: %s", s.id, exc)
        except TimeoutError:
            pass
        for sid in saved:  # saved: its offloaded copy is no longer this process's to delete
            self._host.pop(sid, None)
            self._disk.discard(sid)
        missed = [s.id for s in todo if s.id not in saved]
        if missed:
            log.warning(
                "= %d sessions not saved within %.1f s: %s", len(missed), timeout_s, ", ".join(missed)
            )
        log.info("= saved %d sessions to %s", len(saved), store.root)
        return saved, missed

    async def restore_saved(self, store: StateStore) -> tuple[list[str], list[str]]:
        """Bring back every session saved in `store` as a detached session with its old id and
        resume token (its TTL starts now). An entry that cannot be restored (damaged bytes,
        another model or weights, no room) is moved aside (`StateStore.refuse`) and logged by
        name and reason; the others restore. A restored entry leaves the store (the next stop
        saves it again). Returns (restored, refused) ids."""
        restored: list[str] = []
        refused: list[str] = []
        loop = asyncio.get_running_loop()
        for sid in store.entries():
            try:
                data = await loop.run_in_executor(None, store.read, sid)
                rec_token = _saved_token(data)
                await self._restore(sid, data, None, None, rec_token)
            except (StoreError, SessionError) as exc:
                why = getattr(exc, "message", None) or str(exc)
                log.error("= saved session %s refused: %s (moved to %s)", sid, why, store.refuse(sid, why))
                refused.append(sid)
                continue
            store.remove(sid)
            restored.append(sid)
        if restored:
            log.info("= restored %d sessions from %s", len(restored), store.root)
        return restored, refused

    # -- migration (cluster drain) -------------------------------------------------------------

    async def hand_over(self, session: Session) -> bytes:
        """Snapshot `session` to move it to another server: its outstanding chunks commit first
        (their frames still go out here), then it stays held (no new chunk) so nothing happens
        after the snapshot. The resume token's hash is in the bytes (`take_over` keeps it). The
        caller ends the session once the move succeeded, or `unhold`s it when it failed."""
        await session.hold()
        try:
            session._check_live()
            moving = self._moving.get(session.id)
            if moving is not None:
                await moving
            offloaded = self._host.get(session.id) or self._read_disk(session.id)
            return offloaded or await self._snapshot_held(session, session.token_hash)
        except BaseException:
            session.unhold()
            raise

    async def take_over(self, session_id: str, data: bytes, fork: bool = False) -> Session:
        """A session `hand_over` moved here: same id and resume token, detached until its client
        resumes (with retained chunks re-sent). ``fork``: a `copy_out` of another server's
        session, which owes no chunk (as a fork made here). `InvalidInput` / `SessionBusy` as
        `restore`."""
        if session_id in self._sessions:
            raise InvalidInput(f"data: session {session_id} already lives here", field="data")
        if len(self._sessions) >= self.max_sessions and not self._evict_detached():
            raise SessionBusy(f"server is full ({self.max_sessions} sessions); retry later")
        return await self._restore(session_id, data, None, None, _saved_token(data), owes=not fork)

    async def copy_out(self, session: Session, token: str) -> bytes:
        """`session`'s committed world as snapshot bytes for a fork on another server, answering
        to resume token ``token`` there (`take_over` with ``fork``); the session goes on."""
        await session.hold()
        try:
            session._check_live()
            return await self._snapshot_held(session, token_hash(token))
        finally:
            session.unhold()

    async def checkpoint(self, session: Session) -> tuple[bytes, int]:
        """A snapshot of `session` to bring it back elsewhere if this server dies (a cluster's
        failover): like `snapshot`, with the resume token's hash, so `take_over` keeps the
        token. Returns the bytes and the last chunk in them."""
        data = self._host.get(session.id) or self._read_disk(session.id)
        if data is not None:
            return data, session.last_chunk
        await session.hold(defer_steps=True)  # its client knows nothing of it: steps wait
        try:
            session._check_live()
            return await self._snapshot_held(session, session.token_hash), session.last_chunk
        finally:
            session.unhold(defer_steps=True)

    def has_token(self, token: str) -> bool:
        """Whether a live session here answers to this resume token (no side effect)."""
        return token_hash(token) in self._by_token

    # -- offload ---------------------------------------------------------------------------------
    #
    # With `host_memory`, a device budget that cannot take a new or returning session does not
    # close the longest-detached session: it moves it off the device instead (its snapshot bytes,
    # runtime/snapshot.py, to host memory; its device row freed), the longest-detached first. Past
    # `host_memory` the longest-offloaded go on to `spill` (disk), or are closed without one. A
    # session comes back to the device when its client resumes (`ensure_resident`), making room
    # the same way; `busy` only when no detached session is left to move. Offloaded sessions
    # still count against `max_sessions` and their detach TTL.

    def residence(self) -> dict[str, tuple[int, int]]:
        """(sessions, bytes) on the device, in host memory and on disk (/metrics)."""
        device = [s for s in self._sessions.values() if s.id not in self._host and s.id not in self._disk]
        disk_bytes = 0
        for sid in self._disk:
            with contextlib.suppress(OSError, ValueError):
                disk_bytes += self.spill.size(sid) if self.spill is not None else 0
        return {
            "device": (len(device), self.engine_bytes()),
            "host": (len(self._host), sum(len(b) for b in self._host.values())),
            "disk": (len(self._disk), disk_bytes),
        }

    def engine_bytes(self) -> int:
        """Device bytes the engine charges live streams (its budget's `used`)."""
        return self.engine.used_bytes()

    def offloaded(self, session: Session) -> str | None:
        """ "host" or "disk" while `session` is off the device, else None."""
        if session.id in self._host:
            return "host"
        return "disk" if session.id in self._disk else None

    async def _device_room(self, keep: Session | None = None) -> bool:
        """Make room on the device for one more session: offload the longest-detached resident
        session (with `host_memory`), else close it (`_evict_detached`). False: none left."""
        if self.host_memory is None:
            return self._evict_detached()
        movable = [
            s
            for s in self._sessions.values()
            if s.status is SessionStatus.DETACHED
            and s is not keep
            and s.id not in self._host
            and s.id not in self._disk
            and s.id not in self._moving
        ]
        if not movable:
            return False
        return await self._offload(min(movable, key=lambda s: s.detached_at or 0.0))

    async def _offload(self, session: Session) -> bool:
        """Move a detached session's world off the device (see above); False when it was
        attached again or ended meanwhile (it then stays as it is)."""
        moving = asyncio.get_running_loop().create_future()
        self._moving[session.id] = moving
        try:
            await session.hold()
            try:
                if session.status is not SessionStatus.DETACHED:
                    return False
                data = await self._snapshot_held(session, session.token_hash)
                await self._engine_call(lambda: self.engine.remove_stream(session.id))
            finally:
                session.unhold()
            self._host[session.id] = data
            log.info("= session %s offloaded to host memory (%d bytes)", session.id, len(data))
            await self._trim_host()
            return True
        finally:
            self._moving.pop(session.id, None)
            moving.set_result(None)

    async def _trim_host(self) -> None:
        """Past `host_memory`: the longest-offloaded sessions go to `spill`, or end."""
        assert self.host_memory is not None
        while self._host and sum(len(b) for b in self._host.values()) > self.host_memory:
            sid = next(iter(self._host))
            if self.spill is None:
                log.info("= session %s closed: host memory for offloaded sessions is full", sid)
                self._sessions[sid].finish(SessionStatus.EXPIRED)
                continue
            data = self._host.pop(sid)
            await asyncio.get_running_loop().run_in_executor(None, self.spill.write, sid, data)
            self._disk.add(sid)
            log.info("= session %s offloaded to disk", sid)

    def _read_disk(self, session_id: str) -> bytes | None:
        if session_id not in self._disk or self.spill is None:
            return None
        return self.spill.read(session_id)

    async def ensure_resident(self, session: Session) -> None:
        """Bring an offloaded session's world back to the device (a resume), making room as an
        `open` does; `SessionBusy` when there is none (the session stays offloaded)."""
        moving = self._moving.get(session.id)
        if moving is not None:
            await moving
        where = self.offloaded(session)
        if where is None:
            return
        loop = asyncio.get_running_loop()
        data = self._host.get(session.id)
        if data is None:
            try:
                data = await loop.run_in_executor(None, self._read_disk, session.id)
            except StoreError as exc:
                session.finish(SessionStatus.FAILED)
                raise SessionNotFound(f"offloaded session lost: {exc}") from exc
        assert data is not None
        while True:
            try:
                await self._engine_call(lambda: self.engine.restore_stream(session.id, data))
                break
            except SessionBusy as exc:
                if not isinstance(exc.__cause__, OutOfBudget) or not await self._device_room(keep=session):
                    raise
        self._drop_offloaded(session.id)
        log.info("= session %s back on the device from %s", session.id, where)

    def _drop_offloaded(self, session_id: str) -> None:
        self._host.pop(session_id, None)
        if session_id in self._disk:
            self._disk.discard(session_id)
            if self.spill is not None:
                self.spill.remove(session_id)

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
        session.keep = False  # nobody can resume a one-shot: nothing to save on stop
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


def _random_token() -> str:
    return secrets.token_urlsafe(32)  # 256 bits


def _ignore_result(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("remove_stream: %s", fut.exception())


def _saved_token(data: bytes) -> str:
    """The resume-token hash a saved session keeps (InvalidInput when the bytes have none)."""
    try:
        token = read_manifest(data)["session"]["token_sha256"]
    except (SnapshotError, KeyError, TypeError) as exc:
        raise InvalidInput(f"data: saved session without its token: {exc}", field="data") from exc
    if not isinstance(token, str) or len(token) != 64:
        raise InvalidInput("data: saved session with a malformed token hash", field="data")
    return token


def _record_problem(rec: dict, specs: dict) -> str | None:
    """What is wrong with a snapshot's session record (None: nothing): a save game comes from a
    client, so its numbers are checked before a session is built on them."""
    try:
        if rec.get("model") not in specs:
            return f"session record of model {rec.get('model')!r}"
        if rec.get("mode") not in ("realtime", "lockstep"):
            return f"session mode {rec.get('mode')!r}"
        if not 1 <= int(rec["max_ahead"]) <= 64:
            return f"max_ahead {rec['max_ahead']}"
        numbers = ("seed", "chunk_base", "frame_base", "last_chunk", "acked", "frames_out")
        if any(int(rec[k]) < 0 for k in numbers):
            return "negative counters"
        if not isinstance(rec.get("retained", []), list):
            return "retained chunks are not a list"
    except (KeyError, TypeError, ValueError) as exc:
        return f"incomplete session record: {type(exc).__name__}: {exc}"
    return None

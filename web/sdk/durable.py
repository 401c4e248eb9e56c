"""A lockstep session that survives a dropped socket: steps are neither lost nor repeated.

When the socket drops while a step is outstanding, the client cannot know whether the server got
the step, is generating it, or has committed it. :class:`DurableSession` resumes with the resume
token and settles the question with a ``cancel``: the server re-sends committed unacked chunks
right after ``ready`` (before it reads the ``cancel``), and a ``cancel`` rolls back a chunk still
in flight. So the step's chunk either arrives before ``cancelled`` (it committed: keep it) or the
step is answered ``StepCancelled`` (nothing committed: send it again). A chunk's noise depends
only on the world seed and the chunk number, so a re-sent step makes the frames it would have.
"""

import asyncio
import contextlib
import logging

from web import messages as m
from web.errors import SessionClosed, StepCancelled
from web.sdk.core import ClientCore
from web.sdk.session import Session
from web.sdk.types import Chunk
from web.sdk.urls import session_url

__all__ = ["SERVER_ENDED", "DurableSession"]

log = logging.getLogger(__name__)

# `closed.reason`s: the server ended the session, so there is nothing to resume.
SERVER_ENDED = frozenset({"closed", "done", "expired", "error", "shutdown"})
RECONNECT_TRIES = 6  # resume attempts per drop, 0.2 s apart and doubling (about 12 s in all)


class DurableSession:
    """One lockstep session (async) that resumes transparently after a dropped socket."""

    def __init__(self, url: str, open_msg: m.Open, reconnect_tries: int = RECONNECT_TRIES) -> None:
        if open_msg.mode != "lockstep":
            raise ValueError("DurableSession drives lockstep sessions")
        self.url = url  # the server, as given
        self.open_msg = open_msg  # what `open` sends (model, seed, image, codec, ...)
        self.reconnect_tries = reconnect_tries
        self.resumes = 0  # how many times the socket was resumed
        self.session: Session | None = None

    @property
    def ready(self) -> m.Ready:
        """The server's latest ``ready``."""
        return self._live().ready

    def _live(self) -> Session:
        if self.session is None:
            raise SessionClosed("not open")
        return self.session

    async def open(self) -> m.Ready:
        """Open the session (``open``); the server's ``ready``."""
        session = Session(self.url, ClientCore(self.open_msg.codec))
        try:
            await session.start(session_url(self.url), self.open_msg)
        except BaseException:
            await session.disconnect()
            raise
        self.session = session
        return session.ready

    async def step(self, actions: tuple[m.FrameAction, ...]) -> Chunk:
        """One chunk with these actions (one for all frames, or one per frame), acked."""
        core = self._live().core
        seq, sent = core.next_seq(), False
        while True:
            session = self._live()
            try:
                if not sent:
                    sent = True
                    chunk = await session.call(m.Step(seq=seq, actions=actions), ("step", seq), seq)
                else:
                    chunk = await self._settle(session, seq)
            except SessionClosed as exc:
                if exc.reason in SERVER_ENDED:
                    raise
                await self._resume(exc)
                continue
            if chunk is None:  # the step never committed: send it again under a fresh seq
                seq, sent = session.core.next_seq(), False
                continue
            session.core.chunks.clear()  # lockstep: a chunk no step claimed is stale (a start frame)
            await self._ack(session, chunk)
            return chunk

    async def _settle(self, session: Session, seq: int) -> Chunk | None:
        """After a resume: step ``seq``'s chunk if it committed, None if it never will."""
        for chunk in session.core.chunks:
            if chunk.action_seq == seq:
                return chunk
        session.core.expect(("step", seq), seq)
        cancel = session.core.next_seq()
        await session.call(m.Cancel(seq=cancel), ("cancelled", cancel), cancel)
        try:
            return session.core.take(("step", seq))
        except StepCancelled:
            return None

    async def _ack(self, session: Session, chunk: Chunk) -> None:
        with contextlib.suppress(SessionClosed):  # unacked: a resume re-sends it, and the core drops it
            await session.send(m.Ack(chunk=chunk.chunk))

    async def _resume(self, cause: SessionClosed) -> None:
        """Resume on a new socket, retrying while the server cannot be reached."""
        session = self._live()
        for attempt in range(self.reconnect_tries):
            try:
                await session.reconnect()
            except (OSError, SessionClosed) as exc:
                log.info("resume attempt %d failed: %s", attempt + 1, exc)
                await asyncio.sleep(0.2 * 2**attempt)
                continue
            self.resumes += 1
            log.info("resumed session %s after: %s", session.ready.session_id, cause)
            return
        raise SessionClosed(f"could not resume after {self.reconnect_tries} tries ({cause.reason})")

    async def reset(self, seed: int | None = None, prompt: str | None = None) -> m.Ready:
        """A fresh world in this session (None: the same seed / prompt); the new ``ready``."""
        while True:
            session = self._live()
            seq = session.core.next_seq()
            try:
                ready: m.Ready = await session.call(
                    m.Reset(seq=seq, seed=seed, prompt=prompt), ("ready", None), seq
                )
            except SessionClosed as exc:
                if exc.reason in SERVER_ENDED:
                    raise
                await self._resume(exc)  # resetting twice makes the same world: just send it again
                continue
            session.core.chunks.clear()
            return ready

    async def close(self) -> None:
        """End the session and its socket (idempotent)."""
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()

"""The async SDK's entry points: ``connect`` (open, or attach by token), ``attach``, ``generate``."""

from collections.abc import Generator, Sequence
from typing import Any

from web import messages as m
from web.sdk.actions import ActionLike
from web.sdk.core import ClientCore, generate_message, open_message
from web.sdk.session import Session
from web.sdk.types import Generated
from web.sdk.urls import CONNECT_TIMEOUT_S, session_url

__all__ = ["attach", "connect", "generate", "restore"]


class connect:  # lowercase like websockets' `connect`: awaited or used as a context manager
    """Open a session: ``async with connect(url, mode="lockstep") as s:`` or ``s = await connect(...)``.

    ``url``: ``HOST:PORT``, ``ws://HOST:PORT`` or ``http://HOST:PORT``. With ``resume=TOKEN`` it
    attaches to a live session instead; the other session arguments are then ignored, and
    ``codec`` picks the codec of this socket. ``connect_timeout``: seconds to keep trying to reach
    the server before raising :exc:`~web.errors.ServerUnreachable`. ``prompt``: the text a text
    world starts from (worlds whose ``/v1/models`` entry has ``prompts``).
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        seed: int | None = None,
        prompt: str | None = None,
        mode: m.Mode = "realtime",
        codec: m.Codec = "jpeg",
        token: str | None = None,
        max_ahead: int = 2,
        debug: dict[str, Any] | None = None,
        resume: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.resume = resume
        self.connect_timeout = connect_timeout
        self.open = open_message(model, seed, mode, codec, token, max_ahead, debug, prompt)
        self.session: Session | None = None

    async def _open(self) -> Session:
        session = Session(self.url, ClientCore(self.open.codec), self.connect_timeout)
        try:
            if self.resume is None:
                await session.start(session_url(self.url), self.open)
            else:
                await session.start(session_url(self.url, resume=self.resume, codec=self.open.codec), None)
        except BaseException:
            await session.disconnect()
            raise
        self.session = session
        return session

    def __await__(self) -> Generator[Any, None, Session]:
        return self._open().__await__()

    async def __aenter__(self) -> Session:
        return await self._open()

    async def __aexit__(self, *exc_info: object) -> None:
        if self.session is not None:
            await self.session.close()


def attach(url: str, token: str, *, codec: m.Codec = "jpeg") -> connect:
    """Attach to a live session by resume token (a fork, or a session another process opened)."""
    return connect(url, codec=codec, resume=token)


async def restore(
    url: str,
    data: bytes,
    *,
    mode: m.Mode | None = None,
    codec: m.Codec = "jpeg",
    token: str | None = None,
    connect_timeout: float = CONNECT_TIMEOUT_S,
) -> Session:
    """A new session from a save game (`Session.snapshot`'s bytes), numbered on from it; close it
    with ``await s.close()``. ``mode`` None: the saved session's."""
    session = Session(url, ClientCore(codec), connect_timeout)
    try:
        await session.start(session_url(url), m.Restore(data=data, mode=mode, codec=codec, token=token))
    except BaseException:
        await session.disconnect()
        raise
    return session


async def generate(
    url: str,
    *,
    chunks: int,
    actions: Sequence[ActionLike | Sequence[ActionLike]] = (),
    model: str | None = None,
    seed: int | None = None,
    prompt: str | None = None,
    codec: m.Codec = "jpeg",
    token: str | None = None,
    connect_timeout: float = CONNECT_TIMEOUT_S,
) -> Generated:
    """One-shot: ``chunks`` chunks, ``actions[i]`` driving chunk i + 1 (later chunks get no input)."""
    msg = generate_message(chunks, actions, model, seed, codec, token, prompt)
    session = Session(url, ClientCore(codec), connect_timeout)
    try:
        done: m.Done = await session.start(session_url(url), msg, ("done", None))
    finally:
        await session.disconnect()
    return session.core.generated(done)

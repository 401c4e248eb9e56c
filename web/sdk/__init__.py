"""The worldserve Python SDK: numpy frames from a worldserve server, without torch.

Async::

    from web.sdk import connect
    async with connect("127.0.0.1:8000", mode="lockstep", codec="raw") as s:
        frames = await s.step({"keys": ["w"]})            # (T, H, W, 3) uint8

Sync (scripts, notebooks, robot loops)::

    from web.sdk import Client
    with Client("127.0.0.1:8000") as world:               # lockstep, raw
        frames = world.step({"keys": ["w"]})

Server errors raise :class:`~web.errors.ServerError` carrying the protocol ``code``; when no
server answers within ``connect_timeout`` (default 5 s) the call raises
:class:`~web.errors.ServerUnreachable` (a ``ConnectionError``) naming the URL.
"""

from web.errors import ServerError, ServerUnreachable, SessionClosed, StepCancelled
from web.sdk.aio import attach, connect, generate, restore
from web.sdk.base import BaseWorld
from web.sdk.session import Session
from web.sdk.sync import Client
from web.sdk.types import Chunk, Generated

__all__ = [
    "BaseWorld",
    "Chunk",
    "Client",
    "Generated",
    "ServerError",
    "ServerUnreachable",
    "Session",
    "SessionClosed",
    "StepCancelled",
    "attach",
    "connect",
    "generate",
    "restore",
]

"""What every connection of one server shares: settings, sessions, the encode pool, and which
connection each session is attached to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from weakref import WeakKeyDictionary

if TYPE_CHECKING:  # annotations only: the CLI reads ServerConfig's defaults without loading torch
    from sessions.manager import SessionManager
    from sessions.session import Session
    from web.messages import Codec

__all__ = ["STATIC_DIR", "Hub", "Owner", "ServerConfig"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
CODECS = ("h264", "jpeg", "raw")  # `web.messages.Codec`'s names (that module loads numpy)


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server process (the CLI's `serve` flags)."""

    host: str = "127.0.0.1"  # interface to listen on
    port: int = 8000  # 0: pick a free port (see Server.port)
    token: str | None = None  # required in `open`/`generate` when set
    debug_hooks: bool = False  # accept `open.debug`
    default_model: str | None = None  # None: the first loaded world
    max_sessions: int = 16  # live sessions, detached ones included (an `open` at the limit
    # closes the longest-detached one instead of answering `busy`)
    device_memory: int | None = None  # bytes of every world's session state together (the engine
    # sizes its pools from it and answers `busy` by it); None: room for max_sessions
    detach_ttl_s: float = 60.0  # how long a detached session waits for a resume
    retention: int = 4  # chunks a session can `rewind` by (runtime/history.py; costs memory per session)
    deterministic: bool = False  # frames independent of batch mates (runtime/batch.py; costs speed)
    max_connections: int = 64  # open websockets; a handshake past it gets HTTP 503
    max_connections_per_address: int | None = None  # ... from one client address (IPv6: its /64),
    # loopback included; None: a quarter of max_connections (at least 1); 0: no such cap
    sessions_per_connection: int = 4  # live: the one a connection is attached to + its forks
    forks_per_connection: int = 16  # forks one connection may make in all
    idle_timeout_s: float = 300.0  # no client message for this long closes a live session
    # ("idle"); 0 = never. Neither a one-shot nor a session with a chunk in flight is idle.
    open_timeout_s: float = 10.0  # a connection with no session yet is closed this long after its
    # handshake, whatever it sends (pings do not extend it), so idle sockets cannot hold the
    # connection cap; 0 = the idle timeout
    allow_origins: tuple[str, ...] = ()  # websocket Origins allowed besides same-origin; "*": any
    max_batch: int = 4  # sessions per engine step
    realtime_headroom: float | None = None  # share of the measured chunk rate realtime opens leave
    # free (sessions/capacity.py); None: off. `worldserve serve` turns it on (0.0): in-process
    # servers (tests, notebooks) do not refuse by a rate that depends on how busy the machine is
    overlap_decode: bool | None = None  # decode on a side stream during the next denoise; None: on CUDA
    defer_clean_pass: bool | None = None  # clean pass after the frames are out; None: unless overlapping
    engine_threads: int | None = None  # torch threads of the engine thread; None: the process's
    prompt_threads: int = 1  # torch threads of the prompt worker (a text encoder's encodes)
    max_message: int = 1 << 20  # bytes per client message; bigger ones get `too_large`
    max_snapshot: int = 8 << 20  # bytes of a save game: a `snapshot` past it gets `too_large`, and
    # a `restore` (a connection's first message) may be this big
    host_memory: int | None = None  # bytes of host memory for sessions offloaded from a full device
    # budget (past it they go to state_dir, or close); None: no offload
    state_dir: Path | None = None  # where sessions are saved on stop and restored on start; None: off
    persist_timeout_s: float = 20.0  # on stop, how long saving the sessions may take (the rest: logged)
    outbox_chunks: int = 4  # `frames` messages queued per connection before frames drop
    send_buffer: int = 1 << 18  # kernel send buffer per socket, bytes: frames wait in our queue
    # (where they can be dropped), not in megabytes of autotuned kernel buffer (stale by seconds)
    encode_threads: int = 2  # encode pool size (H.264/JPEG run there, off the event loop)
    ping_interval_s: float = 20.0  # websocket keepalive ping period
    ping_timeout_s: float = 60.0  # above the worst chunk time: no client pong within it closes
    rate: float = 500.0  # client messages per second a connection may send on average
    burst: int = 1000  # ... and in a burst
    static_dir: Path = STATIC_DIR  # the browser client's files

    @property
    def per_address_cap(self) -> int:
        """Open websockets one client address may hold; 0: no cap besides max_connections."""
        if self.max_connections_per_address is not None:
            return self.max_connections_per_address
        return max(1, self.max_connections // 4)


class Owner(Protocol):
    """A connection that can hold a session."""

    def evict(self) -> None:
        """The session was attached to another connection: let go of it and close."""


# (source session, its codec) -> the copy's (session id, resume token), made on another server
ForkElsewhere = Callable[["Session", str], Awaitable[tuple[str, str]]]


@dataclass
class Hub:
    """Shared state of one server's connections (event loop only)."""

    manager: SessionManager
    config: ServerConfig
    pool: Executor  # encode pool
    # makes a fork this server has no room for on another (a cluster replica's peers); raises
    # SessionBusy when none can take it
    fork_elsewhere: ForkElsewhere | None = None
    _owners: WeakKeyDictionary[Session, Owner] = field(default_factory=WeakKeyDictionary)

    def claim(self, session: Session, owner: Owner, codec: Codec) -> None:
        """Attach ``session`` to ``owner``; a previous owner is evicted."""
        previous = self._owners.get(session)
        self._owners[session] = owner
        session.codec = codec
        if previous is not None and previous is not owner:
            previous.evict()

    def owns(self, session: Session, owner: Owner) -> bool:
        """Whether ``owner`` is the connection ``session`` is attached to."""
        return self._owners.get(session) is owner

    def release(self, session: Session, owner: Owner) -> None:
        """``owner`` lets go of ``session`` (no-op if it was not the owner)."""
        if self.owns(session, owner):
            del self._owners[session]

    def codec_of(self, session: Session) -> Codec | None:
        """The codec ``session`` was last attached with (a fork inherits its source's; a
        restored or moved session keeps it through its snapshot), None when unknown."""
        return session.codec if session.codec in CODECS else None  # type: ignore[return-value]

    def remember_codec(self, session: Session, codec: Codec) -> None:
        """Record the codec a not-yet-attached session (a fork) will use by default."""
        session.codec = codec

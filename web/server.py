"""The worldserve server: one websocket + HTTP port in front of a :class:`~web.app.Runtime`.

Usable in-process (tests, notebooks, benchmarks)::

    async with Server(worlds, ServerConfig(port=0)) as server:   # port 0: a free port
        print(server.url)                                         # http://127.0.0.1:PORT

Each websocket is served by a :class:`~web.connection.Connection`; plain HTTP by
:class:`~web.routes.Routes`. Frames are encoded in a small thread pool: never on the event loop,
never on the engine thread.
"""

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve

from models.world import World
from sessions.manager import SessionManager
from sessions.session import Session, SessionStatus
from sessions.store import StateStore
from web import messages as m
from web import metrics
from web.admission import Admission, is_loopback
from web.app import Runtime
from web.connection import Connection
from web.hub import ForkElsewhere, Hub, ServerConfig
from web.routes import SESSION_PATH, Routes

__all__ = ["Server", "ServerConfig", "exposure_warning"]

log = logging.getLogger(__name__)

# websockets closes with 1009 by itself above this; between max_message and it we answer
# `too_large` first, as the protocol asks.
HARD_LIMIT_FACTOR = 4
# A `restore` holds a save game of up to max_snapshot bytes plus its msgpack envelope.
SNAPSHOT_SLACK = 1 << 16
# On stop, how long sockets get to send what is queued (`closed` included) before they are cut: a
# client that stopped reading must not hold the exit (a container stop would SIGKILL us).
DRAIN_S = 2.0


class Listening:
    """Where a listener (a server, a cluster's front end) is reached, once it listens on `_ws`."""

    config: ServerConfig
    _ws: WsServer | None

    @property
    def port(self) -> int:
        """The port listened on (the real one when configured with 0)."""
        if self._ws is None:
            raise RuntimeError("not listening yet")
        return self._ws.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (the browser client; HTTP routes hang off it)."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        """``ws://HOST:PORT/v1/session``, where sessions are opened."""
        return f"ws://{self.config.host}:{self.port}{SESSION_PATH}"


class Server(Listening):
    """Engine, sessions and the websocket endpoint of one process (see the module docstring)."""

    def __init__(
        self,
        worlds: Mapping[str, World],
        config: ServerConfig | None = None,
        new_token: Callable[[], str] | None = None,
        fork_elsewhere: ForkElsewhere | None = None,
    ) -> None:
        """``new_token``: makes resume tokens (None: random; a cluster replica signs its own).
        ``fork_elsewhere``: makes a fork this server has no room for on another (a cluster
        replica's peers; `Hub.fork_elsewhere`)."""
        self.worlds = worlds
        self.new_token = new_token
        self.fork_elsewhere = fork_elsewhere
        self.config = config or ServerConfig()
        self.runtime: Runtime | None = None
        self._hub: Hub | None = None
        self._ws: WsServer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._connections: dict[Connection, asyncio.Task[None]] = {}  # open sockets -> their handler

    @property
    def manager(self) -> SessionManager:
        """The session manager (after start)."""
        if self.runtime is None:
            raise RuntimeError("server not started")
        return self.runtime.manager

    async def start(self) -> None:
        """Start the engine thread, the encode pool and the listener."""
        cfg = self.config
        self.runtime = Runtime.start(
            self.worlds,
            default_model=cfg.default_model,
            max_batch=cfg.max_batch,
            realtime_headroom=cfg.realtime_headroom,
            max_sessions=cfg.max_sessions,
            device_memory=cfg.device_memory,
            overlap_decode=cfg.overlap_decode,
            defer_clean_pass=cfg.defer_clean_pass,
            detach_ttl_s=cfg.detach_ttl_s,
            retention=cfg.retention,
            deterministic=cfg.deterministic,
            debug_hooks=cfg.debug_hooks,
            threads=cfg.engine_threads,
            prompt_threads=cfg.prompt_threads,
            host_memory=cfg.host_memory,
            spill_dir=cfg.state_dir,
            new_token=self.new_token,
        )
        manager = self.runtime.manager
        if cfg.state_dir is not None or cfg.host_memory is not None:
            # Snapshots name their weights by hash: hash them now, off the engine thread, rather
            # than inside the first snapshot (seconds for a billion-parameter world).
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: [w.weights_hash() for w in self.worlds.values()])
        if cfg.state_dir is not None:
            await manager.restore_saved(StateStore(cfg.state_dir))
        self._pool = ThreadPoolExecutor(cfg.encode_threads, thread_name_prefix="worldserve-encode")
        self._hub = Hub(manager, cfg, self._pool, fork_elsewhere=self.fork_elsewhere)
        metrics.SESSIONS.set_function(lambda: len(manager))
        for where in ("device", "host", "disk"):
            metrics.SESSIONS_WHERE.labels(where).set_function(lambda w=where: manager.residence()[w][0])
            metrics.SESSION_BYTES.labels(where).set_function(lambda w=where: manager.residence()[w][1])
        self._ws = await serve(
            self._handle,
            cfg.host,
            cfg.port,
            compression=None,  # deflate costs 25-35x on video payloads
            process_request=Routes(
                manager,
                cfg.static_dir,
                Admission(
                    cfg.max_connections,
                    cfg.allow_origins,
                    per_address=cfg.per_address_cap,
                    loopback_hosts_only=is_loopback(cfg.host),
                ),
                token=cfg.token,
                retention=cfg.retention,
                deterministic_batch=cfg.max_batch if cfg.deterministic else None,
            ),
            max_size=max(cfg.max_message * HARD_LIMIT_FACTOR, cfg.max_snapshot + SNAPSHOT_SLACK),
            ping_interval=cfg.ping_interval_s,
            ping_timeout=cfg.ping_timeout_s,
        )
        log.info("= serving %s at %s", sorted(self.worlds), self.url)
        warning = exposure_warning(cfg)
        if warning is not None:
            log.warning(warning)

    async def stop(self) -> None:
        """Stop accepting; with a state directory, save every live and detached session first
        (`persist`); every session not saved and every running one-shot gets `closed` (reason
        shutdown); sockets get :data:`DRAIN_S` to send what is queued, then are cut; then the
        engine stops."""
        if self._ws is not None:
            self._ws.server.close()  # no new connections; open ones stay for the drain
        saved = await self.persist()
        for conn in list(self._connections):
            if conn.session is not None and conn.session.id in saved:
                conn.suspend()
            else:
                conn.shutdown()
        if self.runtime is not None:
            await self.runtime.manager.shutdown()
        if self._ws is not None:
            await self._drain()
            self._ws.close()
            await self._ws.wait_closed()
        if self.runtime is not None:
            await self.runtime.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        log.info("= stopped")

    async def persist(self) -> set[str]:
        """Save every live and detached session to the state directory within the configured
        time (none without one); returns the ids saved. Their clients are closed with 1001 and
        no `closed`: they resume with their tokens once a server with the same state directory
        is back."""
        cfg = self.config
        if cfg.state_dir is None or self.runtime is None or self.runtime.engine_thread.dead:
            return set()
        saved, _ = await self.runtime.manager.persist(StateStore(cfg.state_dir), cfg.persist_timeout_s)
        return set(saved)

    # -- migration (a cluster replica's drain, web/cluster/) ------------------------------------

    async def hand_over(self) -> dict[str, bytes]:
        """Snapshot every live and detached session to move it to another replica: session id ->
        snapshot bytes (`SessionManager.hand_over`: each stays held until `let_go` or
        `keep`). A session that cannot be snapshotted stays here and is logged."""
        live = (SessionStatus.ACTIVE, SessionStatus.DETACHED)
        out: dict[str, bytes] = {}
        for s in [s for s in self.manager.sessions() if s.status in live and s.keep]:
            try:
                out[s.id] = await self.manager.hand_over(s)
            except Exception as exc:  # one session's failure must not stop the others' move
                log.warning("= session %s not handed over: %s", s.id, exc)
        return out

    def let_go(self, session_ids: list[str]) -> None:
        """The sessions now live on another replica: their sockets close with 1001 and no
        `closed` (the client, or a cluster front end for it, resumes with the token there), and
        their worlds are freed here."""
        wanted = set(session_ids)
        for conn in list(self._connections):
            if conn.session is not None and conn.session.id in wanted:
                conn.suspend("session moved; resume with your token")
        for s in self.manager.sessions():
            if s.id in wanted:
                s.finish(SessionStatus.SHUTDOWN)  # detached now: nobody gets this `closed`

    def remember_codec(self, session: Session, codec: m.Codec) -> None:
        """The codec a session not attached yet (a fork restored from another replica) is
        attached with when its client names none."""
        if self._hub is not None:
            self._hub.remember_codec(session, codec)

    def keep(self, session_ids: list[str]) -> None:
        """The move of these sessions failed: they go on here."""
        for s in self.manager.sessions():
            if s.id in session_ids and not s.status.is_finished:
                s.unhold()

    async def __aenter__(self) -> "Server":
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _drain(self) -> None:
        """Wait up to DRAIN_S for every socket to flush and close; cut the ones still open."""
        handlers = list(self._connections.values())
        if handlers:
            await asyncio.wait(handlers, timeout=DRAIN_S)
        for conn in list(self._connections):  # a client that is not reading
            log.info("= %s did not drain in %.0f s; closing it", conn.ws.id, DRAIN_S)
            conn.ws.transport.abort()

    async def _handle(self, ws: ServerConnection) -> None:
        assert self._hub is not None
        conn = Connection(ws, self._hub)
        task = asyncio.current_task()
        assert task is not None  # websockets runs each handler in a task
        self._connections[conn] = task
        try:
            await conn.run()
        finally:
            del self._connections[conn]


def exposure_warning(config: ServerConfig) -> str | None:
    """The warning to log when the server listens beyond loopback with no token, else None."""
    if config.token is not None or is_loopback(config.host):
        return None
    return (
        f"listening on {config.host or 'every interface'} without --token: anyone who can reach "
        "this port can open sessions"
    )

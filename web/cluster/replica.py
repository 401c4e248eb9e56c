"""One engine replica of a cluster: a whole single-process worldserve server (engine thread,
sessions, websocket endpoint) inside a Ray actor, one per GPU.

The replica boundary is the server's own websocket: the front end (web/cluster/frontend.py)
relays each client's socket to one replica's, so everything a single server does (exact cancel,
resume, fork, rewind, snapshots) happens inside one replica unchanged, and a frame crosses one
extra hop (replica -> front end -> client). The actor's methods are the control plane only:
placement figures, token lookups, drain (hand over / take over / let go) and /metrics.

Runs as an async Ray actor: the server lives on the actor's event loop.
"""

import asyncio
import contextlib
import logging
import socket
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from prometheus_client import generate_latest

from runtime.metrics import REGISTRY
from sessions.errors import SessionBusy
from sessions.session import Session, SessionStatus
from web.app import load_worlds
from web.cluster.tokens import TokenSigner
from web.hub import ServerConfig
from web.server import Server

__all__ = ["Replica", "ReplicaLoad"]

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 60.0  # a peer's answer to a fork's placement or restore
MAX_DISOWNED = 4096  # ids of given-up moves remembered (one drain's sessions fit many times)
ReplicaLoad = dict[str, object]  # what `Replica.load` answers (plain data: it crosses Ray)


def node_address() -> str:
    """An address of this node the front end can reach (loopback when it is the only one)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # not inside Ray (a unit test): this machine
        return socket.gethostbyname(socket.gethostname())


class Replica:
    """The actor's class (see the module docstring); wrap it with ``ray.remote``."""

    def __init__(
        self,
        name: str,
        models: list[str],
        config: ServerConfig,
        secret: bytes,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int = 1,
        host: str | None = "127.0.0.1",
        loader: Callable[[], dict[str, Any]] | None = None,
        namespace: str | None = None,
    ) -> None:
        """``host``: where the replica listens for its front end (loopback: a one-machine
        cluster, where nothing else should reach it; None: this node's address). ``loader``:
        builds the worlds instead of the registry (``models``, ``device`` and ``dtype`` unused).
        ``namespace``: the Ray namespace of this replica's peers (None: none; a fork that finds
        no room here is then `busy`)."""
        self.name = name
        self.host = host
        self.models = models
        self.config = config
        self.signer = TokenSigner(secret)
        self.device = device
        self.dtype = dtype
        self.threads = threads
        self.loader = loader
        self.namespace = namespace
        self.server: Server | None = None
        self.draining = False  # placed no new session once a drain began
        # Sessions the control gave up moving here (`discard`): a take_over still on its way
        # to one drops it. The oldest ids are forgotten past MAX_DISOWNED.
        self._disowned: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> str:
        """Load the worlds and start serving; returns the replica's websocket URL."""
        import torch  # the actor's process: torch is there already (load_worlds)

        torch.set_num_threads(self.threads)
        loop = asyncio.get_running_loop()
        if self.loader is not None:
            worlds = await loop.run_in_executor(None, self.loader)
        else:
            worlds = await loop.run_in_executor(None, load_worlds, self.models, self.device, self.dtype)
        # Every client of a replica is the front end: one address, no origin, so no per-address
        # cap; and the replica listens where the front end can reach it.
        config = replace(
            self.config,
            host=self.host or node_address(),
            port=0,
            max_connections_per_address=0,
            engine_threads=self.threads,
        )
        self.server = Server(
            worlds,
            config,
            new_token=lambda: self.signer.issue(self.name),
            fork_elsewhere=self._fork_elsewhere if self.namespace is not None else None,
        )
        await self.server.start()
        log.info("= replica %s at %s", self.name, self.server.ws_url)
        return self.server.ws_url

    def _server(self) -> Server:
        if self.server is None:
            raise RuntimeError(f"replica {self.name} not started")
        return self.server

    async def load(self) -> ReplicaLoad:
        """Placement figures: sessions, free device bytes, one default-model session's bytes."""
        server = self._server()
        manager = server.manager
        engine = server.runtime.engine_thread if server.runtime is not None else None
        assert engine is not None
        return {
            "name": self.name,
            "url": server.ws_url,
            "sessions": len(manager),
            "max_sessions": manager.max_sessions,
            "free_bytes": engine.free_bytes(),
            "used_bytes": engine.used_bytes(),
            "session_bytes": engine.session_cost(manager.default_model),
            "draining": self.draining,
            "dead": engine.dead,
        }

    async def has(self, token: str) -> bool:
        """Whether a live session here answers to ``token``."""
        return self._server().manager.has_token(token)

    async def hand_over(self) -> dict[str, bytes]:
        """Begin a drain: no new sessions are placed here, and every session is snapshotted
        and held (`Server.hand_over`); the snapshot carries its client's codec."""
        self.draining = True
        return await self._server().hand_over()

    async def take_over(self, sessions: dict[str, bytes]) -> list[str]:
        """Restore sessions another replica handed over (same ids and tokens); returns the ids
        restored (a refused one is logged and left to its old replica; one `discard`ed meanwhile
        is closed again and not in the answer)."""
        server = self._server()
        manager = server.manager
        taken: list[str] = []
        for sid, data in sessions.items():
            if sid in self._disowned:
                continue
            try:
                session = await manager.take_over(sid, data)
            except Exception as exc:  # one refusal must not lose the others
                log.warning("= session %s not taken over by %s: %s", sid, self.name, exc)
                continue
            if sid in self._disowned:  # discarded while it was being restored
                session.finish(SessionStatus.SHUTDOWN)
                continue
            taken.append(sid)
        return taken

    async def discard(self, session_ids: list[str]) -> None:
        """The control gave up moving these sessions here (its `take_over` call failed or timed
        out) and they go on where they were: close any restored here, and make a `take_over`
        still running drop the rest, so no session lives on two replicas."""
        for sid in session_ids:
            self._disowned[sid] = None
            self._disowned.move_to_end(sid)
        while len(self._disowned) > MAX_DISOWNED:
            self._disowned.popitem(last=False)
        wanted = set(session_ids)
        for s in self._server().manager.sessions():
            if s.id in wanted and not s.status.is_finished:
                log.warning("= session %s discarded by %s (its move was given up)", s.id, self.name)
                s.finish(SessionStatus.SHUTDOWN)

    async def take_fork(self, session_id: str, data: bytes, codec: str) -> bool:
        """A peer's fork it had no room for (`Replica._fork_elsewhere`): restored detached, owing
        no chunk, attached by default with its source's codec; False when refused."""
        server = self._server()
        try:
            copy = await server.manager.take_over(session_id, data, fork=True)
        except Exception as exc:  # busy here too, or the bytes were refused
            log.warning("= fork %s not taken by %s: %s", session_id, self.name, exc)
            return False
        if session_id in self._disowned:  # its maker gave up waiting meanwhile
            copy.finish(SessionStatus.SHUTDOWN)
            return False
        server.remember_codec(copy, codec)  # type: ignore[arg-type]  (a codec its source had)
        return True

    async def _fork_elsewhere(self, session: Session, codec: str) -> tuple[str, str]:
        """A fork of ``session`` on the peer with the most free device bytes that has room for
        it (state copied: this replica snapshots the session's committed world, the peer
        restores it under a new id and a token naming the peer); SessionBusy when none has."""
        peers = await self._peers()
        names = list(peers)
        loads = await asyncio.gather(
            *(asyncio.wait_for(peers[n].load.remote(), PEER_TIMEOUT_S) for n in names), return_exceptions=True
        )
        fits = [
            x
            for x in loads
            if isinstance(x, dict)
            and not x["draining"]
            and not x["dead"]
            and int(x["sessions"]) < int(x["max_sessions"])
            and int(x["free_bytes"]) >= int(x["session_bytes"])
        ]
        if not fits:
            raise SessionBusy("no replica has room for a fork; retry later")
        target = str(max(fits, key=lambda x: int(x["free_bytes"]))["name"])
        copy_id, token = uuid.uuid4().hex, self.signer.issue(target)
        data = await self._server().manager.copy_out(session, token)
        call = peers[target].take_fork.remote(copy_id, data, codec)
        try:
            taken = await asyncio.wait_for(call, PEER_TIMEOUT_S)
        except Exception as exc:
            peers[target].discard.remote([copy_id])  # so it does not come up late (not awaited)
            raise SessionBusy(f"replica {target} did not take the fork ({exc}); retry later") from exc
        if not taken:
            raise SessionBusy(f"replica {target} had no room for the fork; retry later")
        log.info("= fork %s of session %s made on %s", copy_id, session.id, target)
        return copy_id, token

    async def _peers(self) -> dict[str, Any]:
        """The other replicas of this cluster (Ray actor handles by name)."""
        import ray  # inside the actor: Ray is there

        def find() -> dict[str, Any]:
            named = ray.util.list_named_actors(all_namespaces=True)
            names = [a["name"] for a in named if a["namespace"] == self.namespace and a["name"] != self.name]
            peers = {}
            for n in names:
                with contextlib.suppress(ValueError):  # gone since the listing
                    peers[n] = ray.get_actor(n, namespace=self.namespace)
            return peers

        return await asyncio.get_running_loop().run_in_executor(None, find)

    async def let_go(self, session_ids: list[str]) -> None:
        """The sessions live elsewhere now (`Server.let_go`)."""
        self._server().let_go(session_ids)

    async def keep(self, session_ids: list[str]) -> None:
        """The move of these sessions failed: they go on here (`Server.keep`)."""
        self._server().keep(session_ids)

    async def checkpoints(
        self, since: dict[str, int]
    ) -> tuple[list[str], dict[str, tuple[int, bytes]]] | None:
        """For a failover: the ids of the sessions that live here, and a snapshot (last chunk,
        bytes) of each whose last chunk differs from ``since`` (what the caller already
        holds). A session that cannot be snapshotted now is left for the next round. None: this
        replica's engine thread has died (its process lives on, its sessions cannot step)."""
        server = self._server()
        engine = server.runtime.engine_thread if server.runtime is not None else None
        if engine is not None and engine.dead:
            return None
        manager = server.manager
        live = [s for s in manager.sessions() if not s.status.is_finished and s.keep]
        if self.draining:  # its sessions are held for the move: their checkpoints stay as they are
            return [s.id for s in live], {}
        fresh: dict[str, tuple[int, bytes]] = {}
        for s in live:
            if since.get(s.id) == s.last_chunk:
                continue
            try:
                data, chunk = await manager.checkpoint(s)
            except Exception as exc:  # closed meanwhile, or held by a drain
                log.debug("= session %s not checkpointed: %s", s.id, exc)
                continue
            fresh[s.id] = (chunk, data)
        return [s.id for s in live], fresh

    async def undrain(self) -> None:
        """Place new sessions here again."""
        self.draining = False

    async def metrics(self) -> bytes:
        """This replica's Prometheus text (the front end adds the replica label)."""
        return generate_latest(REGISTRY)

    async def stop(self) -> None:
        """Stop serving (sessions end with `closed{shutdown}`)."""
        if self.server is not None:
            await self.server.stop()
            self.server = None

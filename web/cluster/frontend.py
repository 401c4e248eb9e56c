"""The websocket front end of a cluster: one port that speaks protocol v1 by relaying each client
socket to one replica's socket (web/cluster/replica.py), so a client cannot tell it from a single
server.

Routing: a new connection goes to the replica `Cluster.place` picks (most free device bytes); a
``?resume=TOKEN`` to the replica the token's session lives on (`Cluster.locate`: a forged or
unknown token gets the single server's fatal `not_found`). Messages pass through unparsed both
ways; only the server's messages up to the first `ready` are read, for the session's token and
codec. When the replica closes a socket with 1001 (its session was moved by a drain), the relay
finds the session's new replica and attaches there with ``?resume=TOKEN``: the client sees one
more `ready` and the chunks it has not acked again (clients drop chunks they already hold).
When a replica's socket drops without a close (1006) and the replica is dead, the session comes
back on another replica from its last checkpoint (`Cluster.suspect`) and the relay attaches there
the same way; that `ready`'s `chunk` is the checkpoint's, and the chunks after it are generated
again. Client messages wait meanwhile (the socket's own receive buffer bounds them).

HTTP: ``/healthz``, ``/metrics`` (every replica's, with a ``replica`` label, and the cluster's
capacity), ``/v1/cluster`` (replicas and their figures), the admin paths
``/v1/cluster/drain?replica=NAME``, ``/v1/cluster/remove?replica=NAME`` and ``/v1/cluster/add``
(jobs: answered 202 with a ``/v1/cluster/jobs/ID`` to poll; they need the server token when
there is one, and come from loopback only when there is none), and any
other path from the replicas (models, the protocol schema, session logs, the browser client).
"""

import asyncio
import http
import json
import logging
import secrets
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import msgpack
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from web import codec
from web import messages as m
from web.admission import Admission, is_loopback
from web.cluster.control import Cluster, capacity
from web.cluster.metrics import merge
from web.connection import MAX_FRAGMENTS
from web.errors import ErrorCode, ProtocolError, close_code
from web.hub import ServerConfig
from web.routes import SESSION_PATH, http_response
from web.server import HARD_LIMIT_FACTOR, SNAPSHOT_SLACK, Listening

__all__ = ["FrontEnd"]

log = logging.getLogger(__name__)

GOING_AWAY = 1001  # a replica let go of the session (drain) or is stopping
ABNORMAL = 1006  # the socket dropped without a close: the replica may have died
SNIFF_LIMIT = 8  # server messages read for the first `ready` at most (then: pass through)
JSON = "application/json"
PROXY_TIMEOUT_S = 10.0
ADMIN = frozenset({"/v1/cluster/drain", "/v1/cluster/remove", "/v1/cluster/add"})
JOBS = "/v1/cluster/jobs/"
MAX_JOBS = 64  # jobs remembered (the oldest finished ones are forgotten first)
MAX_JOBS_RUNNING = 8


class FrontEnd(Listening):
    """The cluster's websocket + HTTP port (see the module docstring)."""

    def __init__(self, cluster: Cluster, config: ServerConfig) -> None:
        self.cluster = cluster
        self.config = config
        self.admission = Admission(
            config.max_connections,
            config.allow_origins,
            per_address=config.per_address_cap,
            loopback_hosts_only=is_loopback(config.host),
        )
        self._ws: WsServer | None = None
        self._jobs: dict[str, dict[str, object]] = {}  # admin jobs by id, the oldest first
        self._tasks: set[asyncio.Task[None]] = set()  # their tasks (kept: the loop holds weak refs)

    async def start(self) -> None:
        """Listen."""
        cfg = self.config
        self._ws = await serve(
            self._handle,
            cfg.host,
            cfg.port,
            compression=None,
            process_request=self._route,
            max_size=max(cfg.max_message * HARD_LIMIT_FACTOR, cfg.max_snapshot + SNAPSHOT_SLACK),
            ping_interval=cfg.ping_interval_s,
            ping_timeout=cfg.ping_timeout_s,
        )
        log.info("= cluster front end at %s (%d replicas)", self.url, len(self.cluster.replicas))

    async def stop(self) -> None:
        """Stop listening; open relays close (their sessions detach on the replicas)."""
        if self._ws is not None:
            self._ws.close()
            await self._ws.wait_closed()

    # -- websocket ------------------------------------------------------------------------------

    async def _handle(self, client: ServerConnection) -> None:
        request = client.request
        query = parse_qs(urlsplit(request.path if request is not None else "").query)
        token = query.get("resume", [None])[0]
        if token is not None:
            name = await self.cluster.locate(token)
            if name is None:
                await _refuse(client, ErrorCode.NOT_FOUND, "unknown or expired resume token")
                return
            await Relay(self.cluster, client, name, query, token, placed=False).run()
            return
        try:
            name = await self.cluster.place()
        except RuntimeError as exc:  # no replica answers
            await _refuse(client, ErrorCode.BUSY, f"{exc}; retry later")
            return
        await Relay(self.cluster, client, name, query, None, placed=True).run()

    # -- HTTP -----------------------------------------------------------------------------------

    async def _route(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.partition("?")[0]
        if not self.admission.host_allowed(request):
            return http_response(http.HTTPStatus.FORBIDDEN, b"host not allowed\n")
        if path == SESSION_PATH:
            return self.admission(connection, request)
        if path == "/healthz":
            return await self._healthz()
        if path == "/metrics":
            return await self._metrics()
        if path == "/v1/cluster":
            body = json.dumps(await self._figures()).encode()
            return http_response(http.HTTPStatus.OK, body, JSON)
        if path in ADMIN:
            return await self._admin(connection, request, path.rpartition("/")[2])
        if path.startswith(JOBS):
            return self._job(connection, request, path.removeprefix(JOBS))
        return await asyncio.get_running_loop().run_in_executor(None, self._proxy, request)

    async def _figures(self) -> dict[str, object]:
        loads = await self.cluster.loads()
        serving = [x for x in loads if not x["draining"] and not x["dead"]]
        return {
            "replicas": loads,
            "capacity_sessions": sum(capacity(x) for x in serving),
            "sessions": sum(int(x["sessions"]) for x in loads),  # type: ignore[call-overload]
        }

    async def _healthz(self) -> Response:
        figures = await self._figures()
        loads = figures["replicas"]
        assert isinstance(loads, list)
        ok = any(not x["dead"] for x in loads)
        body = {
            "status": "ok" if ok else "no_replica",
            "protocol": m.PROTOCOL_VERSION,
            "sessions": figures["sessions"],
            "replicas": len(loads),
            "capacity_sessions": figures["capacity_sessions"],
        }
        status = http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE
        return http_response(status, json.dumps(body).encode(), JSON)

    async def _metrics(self) -> Response:
        texts = await self.cluster.metrics()
        figures = await self._figures()
        loads = figures["replicas"]
        assert isinstance(loads, list)
        cluster = {
            "worldserve_cluster_replicas": (len(loads), "replicas answering"),
            "worldserve_cluster_capacity_sessions": (
                figures["capacity_sessions"],
                "sessions the serving replicas hold in all",
            ),
            "worldserve_cluster_sessions": (figures["sessions"], "sessions on every replica"),
        }
        return http_response(
            http.HTTPStatus.OK, merge(texts, cluster), "text/plain; version=0.0.4; charset=utf-8"
        )

    async def _admin(self, connection: ServerConnection, request: Request, action: str) -> Response:
        """Start a drain, a remove (drain, then stop) or an add of a replica as a job, answered
        at once (202 and the job's path: `_job`), since it can outlast an HTTP request; with the
        server token when there is one, else from loopback only."""
        if not self._admitted(connection, request):
            return http_response(http.HTTPStatus.UNAUTHORIZED, b"missing or wrong token\n")
        name = parse_qs(urlsplit(request.path).query).get("replica", [""])[0]
        if action != "add" and name not in self.cluster.replicas:
            return http_response(http.HTTPStatus.NOT_FOUND, f"no replica {name!r}\n".encode())
        if sum(1 for j in self._jobs.values() if j.get("state") == "running") >= MAX_JOBS_RUNNING:
            return http_response(http.HTTPStatus.SERVICE_UNAVAILABLE, b"too many cluster jobs running\n")
        job_id = secrets.token_hex(8)
        self._jobs[job_id] = {"action": action, "replica": name or None, "state": "running"}
        while len(self._jobs) > MAX_JOBS:  # the oldest finished ones go
            oldest = next((k for k, j in self._jobs.items() if j["state"] != "running"), None)
            if oldest is None:
                break
            del self._jobs[oldest]
        task = asyncio.get_running_loop().create_task(self._run_job(job_id, action, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        body = json.dumps({"job": f"/v1/cluster/jobs/{job_id}"}).encode()
        return http_response(http.HTTPStatus.ACCEPTED, body, JSON)

    async def _run_job(self, job_id: str, action: str, name: str) -> None:
        job = self._jobs[job_id]
        try:
            if action == "add":
                job["replica"] = await self.cluster.add()
            else:
                report = await (self.cluster.remove(name) if action == "remove" else self.cluster.drain(name))
                job.update(moved=report.moved, kept=report.kept)
            job["state"] = "done"
        except Exception as exc:  # reported to whoever asks for the job
            log.exception("= cluster job %s (%s %s) failed", job_id, action, name)
            job.update(state="failed", error=f"{type(exc).__name__}: {exc}")

    def _job(self, connection: ServerConnection, request: Request, job_id: str) -> Response:
        if not self._admitted(connection, request):
            return http_response(http.HTTPStatus.UNAUTHORIZED, b"missing or wrong token\n")
        job = self._jobs.get(job_id)
        if job is None:
            return http_response(http.HTTPStatus.NOT_FOUND, b"no such job\n")
        return http_response(http.HTTPStatus.OK, json.dumps(job).encode(), JSON)

    def _admitted(self, connection: ServerConnection, request: Request) -> bool:
        """The server token (``Authorization: Bearer``) when there is one, else a loopback peer."""
        want = self.config.token
        if want is None:
            peer = connection.remote_address
            return peer is not None and is_loopback(str(peer[0]))
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return secrets.compare_digest(given.encode(), want.encode())

    def _proxy(self, request: Request) -> Response:
        """A plain GET answered by the replicas: the first that does not answer 404 (a session
        log lives on one replica; everything else is the same on each)."""
        last = http_response(http.HTTPStatus.NOT_FOUND, b"not found\n")
        for url in self.cluster.urls.values():
            base = url.replace("ws://", "http://", 1).removesuffix(SESSION_PATH)
            headers = {k: v for k, v in request.headers.raw_items() if k.lower() == "authorization"}
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(base + request.path, headers=headers), timeout=PROXY_TIMEOUT_S
                ) as reply:
                    status, body, kind = reply.status, reply.read(), reply.headers.get("Content-Type", JSON)
            except urllib.error.HTTPError as exc:
                status, body, kind = exc.code, exc.read(), exc.headers.get("Content-Type", "text/plain")
            except OSError:
                continue
            last = http_response(http.HTTPStatus(status), body, kind)
            if status != http.HTTPStatus.NOT_FOUND:
                return last
        return last


class Relay:
    """One client socket relayed to one replica socket at a time (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        client: ServerConnection,
        replica: str,
        query: dict[str, list[str]],
        token: str | None,
        *,
        placed: bool,
    ) -> None:
        self.cluster = cluster
        self.client = client
        self.replica = replica
        self.query = query
        self.token = token  # the attached session's, once known
        self.codec = query.get("codec", [None])[0]
        self.placed = placed  # counted in the cluster's pending placements until `ready`
        self.upstream: ClientConnection | None = None
        self._up = asyncio.Event()  # an upstream socket is open
        self._sniffed = 0
        self._client_gone = False

    async def run(self) -> None:
        """Relay until either side ends."""
        try:
            await self._connect(self.query)
        except (OSError, ConnectionClosed) as exc:
            self._settled()
            log.warning("= replica %s unreachable: %s", self.replica, exc)
            await _refuse(self.client, ErrorCode.BUSY, f"replica {self.replica} unreachable; retry later")
            return
        inbound = asyncio.create_task(self._inbound(), name="relay-in")
        try:
            await self._outbound()
        finally:
            self._settled()
            inbound.cancel()
            if self.upstream is not None:
                await self.upstream.close()

    async def _connect(self, query: dict[str, list[str]]) -> None:
        url = self.cluster.urls[self.replica]
        flat = {k: v[0] for k, v in query.items()}
        target = url + ("?" + urlencode(flat) if flat else "")
        self.upstream = await ws_connect(target, compression=None, max_size=None, proxy=None)
        self._up.set()

    def _settled(self) -> None:
        if self.placed:
            self.placed = False
            self.cluster.placed(self.replica)

    async def _inbound(self) -> None:
        """Client -> replica, each message with as many fragments as the client sent (the
        replica judges them, as a single server does). A message the old replica's socket
        refused goes to the new one."""
        try:
            while True:
                parts: list[Any] = []
                async for part in self.client.recv_streaming():
                    if len(parts) <= MAX_FRAGMENTS:  # past it the replica refuses the message
                        parts.append(part)  # (too_large) whatever follows: not kept
                await self._forward(parts)
        except ConnectionClosed:
            pass
        self._client_gone = True  # the client left: its session detaches on the replica
        if self.upstream is not None:
            await self.upstream.close()

    async def _forward(self, parts: list[Any]) -> None:
        """One client message to the attached replica, waiting out a reattach."""
        # websockets sends an iterable as its items then an empty final frame: the last two
        # parts go as one, so the replica counts the client's fragments.
        data = parts[0] if len(parts) == 1 else [*parts[:-2], parts[-2] + parts[-1]] if parts else b""
        while True:
            await self._up.wait()
            up = self.upstream
            assert up is not None
            try:
                await up.send(data)
                return
            except ConnectionClosed:
                if self.upstream is up:
                    self._up.clear()  # `_outbound` reattaches (or ends the relay)

    async def _outbound(self) -> None:
        """Replica -> client, reattaching when a drain moved the session."""
        while True:
            assert self.upstream is not None
            try:
                async for data in self.upstream:
                    self._sniff(data)
                    await self.client.send(data)
            except ConnectionClosed:
                pass
            if self._client_gone:
                return
            self._up.clear()
            code, reason = self.upstream.close_code, self.upstream.close_reason
            moved = code in (GOING_AWAY, ABNORMAL) and self.token is not None
            if moved and await self._reattach(died=code == ABNORMAL):
                continue
            if code is None or code == ABNORMAL:  # not a code one may send: the replica failed
                code, reason = 1011, "replica lost"
            await self.client.close(code, reason or "")
            return

    async def _reattach(self, died: bool) -> bool:
        """Attach to the replica the session moved to (``died``: its replica dropped the socket;
        it may come back from its checkpoint); False when it moved nowhere."""
        assert self.token is not None
        name = await self.cluster.find_moved(self.token, self.replica, died)
        if name is None:
            return False
        self.replica = name
        query = {"resume": [self.token]}
        if self.codec:
            query["codec"] = [self.codec]
        try:
            await self._connect(query)
        except (OSError, ConnectionClosed):
            return False
        log.info("= session moved to %s; relay reattached", name)
        return True

    def _sniff(self, data: bytes | str) -> None:
        """Learn the session's token and codec from the first `ready` (then read nothing more)."""
        if self._sniffed >= SNIFF_LIMIT or not isinstance(data, bytes):
            return
        self._sniffed += 1
        try:
            msg = msgpack.unpackb(data, raw=False)
        except Exception:  # the replica sent it, the client parses it: not ours to judge
            return
        if isinstance(msg, dict) and msg.get("type") == "ready":
            self._sniffed = SNIFF_LIMIT
            self._settled()
            self.token = self.token or msg.get("resume_token") or None
            self.codec = (msg.get("codec") or {}).get("name") or self.codec


async def _refuse(client: ServerConnection, code: ErrorCode, message: str) -> None:
    """Answer as a single server does a fatal error before anything is attached."""
    error = ProtocolError(code, message, fatal=True)
    try:
        await client.send(codec.encode(m.Error.from_exception(error)))
        await client.close(close_code(code), code.value)
    except ConnectionClosed:
        pass

"""Plain HTTP on the websocket port, answered from ``process_request`` (openpi's ``/healthz`` seam).

Routes: ``/healthz`` (JSON), ``/metrics`` (Prometheus text), ``/v1/models`` (JSON list),
``/v1/protocol.json`` (JSON schema of every message), ``/v1/sessions/{id}/log`` (a live session's
action log, web/sessionlog.py; with a server token it wants ``Authorization: Bearer TOKEN``),
``/`` and any other file under the static
directory (the browser client). ``/v1/session`` goes on to the websocket handshake once
:mod:`web.admission` lets it (a request without ``Upgrade`` gets websockets' own 426). Every
path, the handshake's too, first needs a ``Host`` the admission accepts (DNS rebinding), else
HTTP 403.
"""

import email.utils
import http
import json
import mimetypes
import secrets
from collections.abc import Awaitable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from runtime.errors import StreamNotFound
from runtime.metrics import REGISTRY
from sessions.errors import SessionNotFound
from sessions.manager import SessionManager
from web import convert
from web.admission import Admission
from web.messages import PROTOCOL_VERSION, json_schema
from web.sessionlog import session_log

__all__ = ["SESSION_PATH", "Routes", "http_response"]

SESSION_PATH = "/v1/session"
SESSIONS_PREFIX = "/v1/sessions/"  # + {id}/log
JSON = "application/json"


class Routes:
    """The ``process_request`` callable of one server."""

    def __init__(
        self,
        manager: SessionManager,
        static_dir: Path,
        admission: Admission | None = None,
        token: str | None = None,
        retention: int = 0,
        deterministic_batch: int | None = None,
    ) -> None:
        self.manager = manager
        self.static_dir = static_dir.resolve()
        self.admission = admission  # the Host check, and the handshake checks of SESSION_PATH
        self.token = token  # the server token: wanted by the session log route when set
        self.retention = retention  # the engine's rewind retention, reported in session logs
        self.deterministic_batch = deterministic_batch  # --deterministic's batch size, likewise
        self._schema = json.dumps(json_schema()).encode()  # constant: built once

    def __call__(
        self, connection: ServerConnection, request: Request
    ) -> Response | Awaitable[Response] | None:
        """A response for plain HTTP requests (awaitable where it needs the engine: websockets awaits
        it); None lets a websocket handshake proceed."""
        path = request.path.partition("?")[0]
        if self.admission is not None and not self.admission.host_allowed(request):
            return http_response(http.HTTPStatus.FORBIDDEN, b"host not allowed\n")  # every path
        if path == SESSION_PATH:
            return None if self.admission is None else self.admission(connection, request)
        if "Upgrade" in request.headers:
            return http_response(http.HTTPStatus.NOT_FOUND, b"websocket sessions live at /v1/session\n")
        if path == "/healthz":
            return self._healthz()
        if path == "/metrics":
            return http_response(http.HTTPStatus.OK, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        if path == "/v1/models":
            return http_response(http.HTTPStatus.OK, json.dumps(self._models()).encode(), JSON)
        if path == "/v1/protocol.json":
            return http_response(http.HTTPStatus.OK, self._schema, JSON)
        if path.startswith(SESSIONS_PREFIX) and path.endswith("/log"):
            return self._log(request, path.removeprefix(SESSIONS_PREFIX).removesuffix("/log"))
        return self._static(path)

    async def _log(self, request: Request, session_id: str) -> Response:
        """A live session's action log as JSON; 401 without the server's token (when it has
        one: ``Authorization: Bearer TOKEN`` or ``?token=TOKEN``), 404 for an unknown session."""
        if self.token is not None:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            given = given or parse_qs(urlsplit(request.path).query).get("token", [""])[0]
            if not secrets.compare_digest(given.encode(), self.token.encode()):
                return http_response(http.HTTPStatus.UNAUTHORIZED, b"missing or wrong token\n")
        try:
            session = self.manager.get(session_id)
        except SessionNotFound:
            return http_response(http.HTTPStatus.NOT_FOUND, b"no such session\n")
        try:
            log = await session_log(session, self.retention, self.deterministic_batch)
        except StreamNotFound:  # closed meanwhile
            return http_response(http.HTTPStatus.NOT_FOUND, b"no such session\n")
        body = log.model_dump_json().encode()
        return http_response(http.HTTPStatus.OK, body, JSON)

    def _healthz(self) -> Response:
        dead = self.manager.engine.dead
        body = {
            "status": "engine_dead" if dead else "ok",
            "protocol": PROTOCOL_VERSION,
            "sessions": len(self.manager),
            "models": sorted(self.manager.models()),
        }
        status = http.HTTPStatus.SERVICE_UNAVAILABLE if dead else http.HTTPStatus.OK
        return http_response(status, json.dumps(body).encode(), JSON)

    def _models(self) -> list[dict]:
        out = []
        for model_id, spec in sorted(self.manager.models().items()):
            info = convert.model_info(spec).model_dump()
            out.append(
                {
                    **info,
                    "image_start": spec.image_start,
                    "prompts": spec.prompts,
                    "description": spec.description,
                    "default": model_id == self.manager.default_model,
                }
            )
        return out

    def _static(self, path: str) -> Response:
        relative = "index.html" if path == "/" else path.lstrip("/")
        if "\x00" in relative:  # no file name holds one; the OS would refuse it with ValueError
            return http_response(http.HTTPStatus.BAD_REQUEST, b"bad path\n")
        try:
            file = (self.static_dir / relative).resolve()
            # resolve() folds `..` and links: anything outside the static directory is not ours
            found = file.is_relative_to(self.static_dir) and file.is_file()
        except OSError:  # a name too long for the file system, and the like: not one of ours
            found = False
        if not found:
            return http_response(http.HTTPStatus.NOT_FOUND, b"not found\n")
        content_type = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        if content_type.startswith("text/") or content_type == "application/javascript":
            content_type += "; charset=utf-8"
        return http_response(http.HTTPStatus.OK, file.read_bytes(), content_type)


def http_response(
    status: http.HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8"
) -> Response:
    """A plain HTTP answer to a request on the websocket port (also the cluster front end's)."""
    headers = Headers(
        [
            ("Date", email.utils.formatdate(usegmt=True)),
            ("Connection", "close"),
            ("Content-Length", str(len(body))),
            ("Content-Type", content_type),
            ("Cache-Control", "no-cache"),
        ]
    )
    return Response(status.value, status.phrase, headers, body)

"""Where a client connects: any of ``ws://HOST:PORT``, ``http://HOST:PORT`` or the full session URL."""

from urllib.parse import urlencode, urlsplit, urlunsplit

__all__ = ["CLIENT_MAX_SIZE", "CONNECT_TIMEOUT_S", "RETRY_S", "session_url"]

SESSION_PATH = "/v1/session"
CLIENT_MAX_SIZE = 1 << 28  # inbound bytes per message: raw frames are big (640x360x12 is 8 MB)
CONNECT_TIMEOUT_S = 5.0  # default connect timeout: when no server runs, fail fast
RETRY_S = 0.25  # pause between connection attempts within the connect timeout


def session_url(url: str, *, resume: str | None = None, codec: str | None = None) -> str:
    """The websocket URL of the session endpoint, with ``?resume=TOKEN[&codec=...]`` when resuming."""
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    query = {k: v for k, v in (("resume", resume), ("codec", codec)) if v is not None}
    return urlunsplit((scheme, parts.netloc, SESSION_PATH, urlencode(query), ""))

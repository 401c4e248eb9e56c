"""Prometheus metrics of the web layer, on the runtime's registry (served at /metrics with it)."""

from prometheus_client import Counter, Gauge, Histogram

from runtime.metrics import REGISTRY

__all__ = [
    "CONNECTIONS",
    "CONNECTIONS_TOTAL",
    "DROPPED_FRAMES",
    "ENCODE_MS",
    "ERRORS",
    "MESSAGES_IN",
    "SESSIONS",
    "SESSIONS_WHERE",
    "SESSION_BYTES",
]

ENCODE_BUCKETS_MS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)

CONNECTIONS = Gauge("worldserve_ws_connections_open", "Open websocket connections.", registry=REGISTRY)
CONNECTIONS_TOTAL = Counter(
    "worldserve_ws_connections_total", "Websocket connections accepted.", registry=REGISTRY
)
SESSIONS = Gauge(
    "worldserve_sessions", "Live sessions (attached or detached), read at scrape time.", registry=REGISTRY
)
SESSIONS_WHERE = Gauge(
    "worldserve_sessions_by_residence",
    "Live sessions by where their world is: device, host (offloaded), disk (offloaded past "
    "--host-memory); read at scrape time.",
    ["where"],
    registry=REGISTRY,
)
SESSION_BYTES = Gauge(
    "worldserve_session_bytes_by_residence",
    "Bytes of the live sessions' worlds by where they are (device: charged to the budget; host, "
    "disk: their snapshots); read at scrape time.",
    ["where"],
    registry=REGISTRY,
)
MESSAGES_IN = Counter(
    "worldserve_messages_in_total", "Client messages parsed, by type.", ["type"], registry=REGISTRY
)
ERRORS = Counter("worldserve_errors_total", "`error` messages sent, by code.", ["code"], registry=REGISTRY)
DROPPED_FRAMES = Counter(
    "worldserve_dropped_frames_total",
    "Frames dropped from outbound queues of clients that read too slowly, by codec.",
    ["codec"],
    registry=REGISTRY,
)
ENCODE_MS = Histogram(
    "worldserve_encode_ms",
    "Milliseconds per frame to encode and pack a chunk, by codec.",
    ["codec"],
    buckets=ENCODE_BUCKETS_MS,
    registry=REGISTRY,
)

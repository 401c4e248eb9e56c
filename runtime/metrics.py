"""Prometheus metrics of the runtime, on a registry of our own (the web layer adds its metrics to it
and serves it at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

STAGE_BUCKETS_MS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 250, 400, 700, 1000, 2000, 5000)

CHUNKS = Counter(
    "worldserve_chunks_total", "Chunk transactions by outcome.", ["model", "outcome"], registry=REGISTRY
)
CHUNK_STAGE_MS = Histogram(
    "worldserve_chunk_stage_ms",
    "Milliseconds per chunk stage (queue, denoise, context, decode, total).",
    ["stage"],
    buckets=STAGE_BUCKETS_MS,
    registry=REGISTRY,
)
STREAMS = Gauge("worldserve_streams", "Worlds resident on the device.", registry=REGISTRY)
KV_BYTES = Gauge(
    "worldserve_kv_bytes",
    "Bytes reserved on the device for sessions (K/V rows, plug-in state).",
    registry=REGISTRY,
)
BATCH_SIZE = Histogram(
    "worldserve_batch_size",
    "Sessions per engine step.",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16),
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "worldserve_queue_wait_seconds",
    "Seconds from a chunk's submit until a batch took it, by model and mode (realtime, lockstep).",
    ["model", "mode"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
    registry=REGISTRY,
)
QUEUED = Gauge(
    "worldserve_queued_chunks",
    "Chunk requests waiting for a batch at the last engine step.",
    registry=REGISTRY,
)
CHUNK_RATE = Gauge(
    "worldserve_chunk_rate",
    "Measured chunks per second of a world at its best batch size so far (realtime admission's capacity).",
    ["model"],
    registry=REGISTRY,
)
PROMPT_ENCODE_MS = Histogram(
    "worldserve_prompt_encode_ms",
    "Milliseconds per prompt encoded by the text encoder (cache misses; on the prompt worker).",
    buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000),
    registry=REGISTRY,
)
PROMPT_CACHE = Counter(
    "worldserve_prompt_cache",
    "Prompts asked of a text encoder, by result: hit (already encoded) or miss (encoded now).",
    ["result"],
    registry=REGISTRY,
)
PROMPT_CACHE_BYTES = Gauge(
    "worldserve_prompt_cache_bytes",
    "Bytes of encoded prompts held by the text encoders' caches.",
    registry=REGISTRY,
)

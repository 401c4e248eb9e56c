"""Real servers on loopback over the small test worlds, for the server, SDK and CLI tests."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from models.world import World
from tests.runtime.conftest import small_world
from web import codec
from web import messages as m
from web.server import Listening, Server, ServerConfig


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # The engine thread, the encode pool and the event loop share 2 cores here; torch's default
    # of one spinning intra-op thread per core would make every chunk wait on the others.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def smooth_world() -> World:
    """`small_world` (32x32) whose frames are smooth yet still made by the model: a gradient and a
    soft-edged disc whose colour and position follow each frame the model decodes. Random weights
    decode to noise, which no 4:2:0 codec keeps at 35 dB; these frames are what a trained world's
    look like to an encoder."""
    world = small_world(name="smooth")
    decode, decode_batch = world.decode, world.decode_batch

    def smooth_decode(latents: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        frames, cache = decode(latents, state)
        return smooth(frames), cache

    def smooth_decode_batch(latents: Any, states: Any) -> tuple[list[torch.Tensor], Any]:
        frames, caches = decode_batch(latents, states)
        return [smooth(f) for f in frames], caches

    world.decode = smooth_decode  # type: ignore[method-assign]
    world.decode_batch = smooth_decode_batch  # type: ignore[method-assign]
    return world


def smooth(frames: torch.Tensor) -> torch.Tensor:
    """(T, H, W, 3) uint8 noise -> smooth frames driven by each frame's mean colour."""
    _, h, w, _ = frames.shape
    mean = frames.float().mean(dim=(1, 2)) / 255  # (T, 3) in 0..1
    y, x = torch.meshgrid(
        torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
    )
    base = torch.stack([60 + 120 * x / w, 50 + 150 * y / h, 90 + 80 * (x + y) / (w + h)], dim=-1)  # (H, W, 3)
    cy = h * (0.2 + 0.6 * mean[:, 0])  # (T,)
    cx = w * (0.2 + 0.6 * mean[:, 1])
    dist = torch.hypot(y[None] - cy[:, None, None], x[None] - cx[:, None, None])  # (T, H, W)
    disc = ((h / 4 - dist) / 4).clamp(0, 1)[..., None]  # soft edge, 4 px
    colour = 100 + 150 * mean[:, None, None, :]  # (T, 1, 1, 3)
    out = base[None] * (1 - disc) + colour * disc
    return out.round().clamp(0, 255).to(torch.uint8)


def make_worlds() -> dict[str, World]:
    """The small test worlds by name (a cluster's replicas build theirs with this too)."""
    return {
        "tiny": small_world(),
        "tiny-image": small_world(image_start=True, name="tiny-image"),
        "smooth": smooth_world(),
    }


@pytest.fixture(scope="session")
def worlds() -> dict[str, World]:
    return make_worlds()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def serving(worlds: dict[str, World], **config: Any) -> AsyncIterator[Server]:
    """A server on a free loopback port; `config` overrides ServerConfig fields."""
    server = Server(worlds, ServerConfig(**{"port": 0, "default_model": "tiny", **config}))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.contextmanager
def serving_in_thread(worlds: dict[str, World], **config: Any) -> Iterator[Server]:
    """A server running on its own event loop in a thread (for sync clients)."""
    loop = asyncio.new_event_loop()
    server = Server(worlds, ServerConfig(**{"port": 0, "default_model": "tiny", **config}))
    started = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        async with server:
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(60), "server did not start"
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()


# What the cluster variant of `v1` runs with beyond ServerConfig's defaults: a test that asks
# `v1` for another setting cannot have a cluster variant.
CLUSTER_CONFIG: dict[str, Any] = {"debug_hooks": True, "retention": 2}


@pytest.fixture(scope="package")
def ray_local() -> Iterator[None]:
    """A local Ray instance for the package's cluster tests (skipped without the extra)."""
    ray = pytest.importorskip("ray")
    # The replicas import the repository's modules (tests' world loader included) by name.
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="package")
def cluster_front(ray_local: None) -> Iterator[Any]:
    """Two CPU replicas of the small test worlds behind a front end, shared by the package's
    `v1[cluster]` tests (a `tests.web.cluster_harness.Running`)."""
    from tests.web.cluster_harness import Running
    from web.cluster.control import ReplicaSpec

    # room for the 32-session test's opens at once beside what other tests leave detached
    replica = ServerConfig(port=0, default_model="tiny", max_sessions=24, **CLUSTER_CONFIG)
    front = ServerConfig(port=0, max_connections=256, max_connections_per_address=0)
    spec = ReplicaSpec(models=(), config=replica, cpus=0.5, loader=make_worlds, namespace="worldserve-v1")
    with Running(2, spec, front, checkpoint_s=1.0) as running:
        yield running


@pytest.fixture(params=["single", "cluster"])
def v1(request: pytest.FixtureRequest, worlds: dict[str, World]) -> Callable[..., Any]:
    """Where a protocol-level test's client connects: ``async with v1(**config) as server`` (use
    only ``server.url`` / ``server.ws_url``). "single": a server of its own (`serving`);
    "cluster": the package's cluster front end (`cluster_front`), which a v1 client must not tell
    from a single server (docs/PROTOCOL.md); its config is CLUSTER_CONFIG."""
    if request.param == "single":
        return functools.partial(serving, worlds)
    running = request.getfixturevalue("cluster_front")

    @contextlib.asynccontextmanager
    async def front(**config: Any) -> AsyncIterator[Any]:
        differs = {k: v for k, v in config.items() if CLUSTER_CONFIG.get(k) != v}
        assert not differs, f"the cluster variant runs with {CLUSTER_CONFIG}, not {differs}"
        yield running.front

    return front


async def dial(server: Listening, query: str = "") -> ClientConnection:
    """A raw protocol client (no SDK)."""
    return await ws_connect(server.ws_url + query, proxy=None, compression=None, max_size=None)


async def recv(ws: ClientConnection, timeout: float = 60.0) -> m.ServerMessage:
    """The next server message, parsed."""
    data = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(data, bytes)
    return codec.parse_server(data)


async def send(ws: ClientConnection, msg: m.ClientMessage) -> None:
    await ws.send(codec.encode(msg))


async def recv_until(ws: ClientConnection, kind: type, timeout: float = 60.0) -> list[m.ServerMessage]:
    """Messages up to and including the first of type `kind`."""
    out = []
    while True:
        msg = await recv(ws, timeout)
        out.append(msg)
        if isinstance(msg, kind):
            return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255**2 / mse))

"""Small worlds and helpers for the runtime tests (fp32, CPU)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from models.actions import FrameAction
from models.registry import build_world, tiny_random_configs
from models.tiny_world.plugin import TinyWorldPlugin, TinyWorldSettings
from models.world import World
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest, Outcome


def small_world(
    image_start: bool = False, context_noise: float = 0.0, name: str = "tiny", carry: tuple[int, ...] = ()
) -> World:
    """tiny-random's architecture at 32x32 (fast), optionally image-started or carrying latent
    channels from each chunk's latest frame (the tiny world's plug-in, `carry_channels`)."""
    world, dit, vae = tiny_random_configs()
    world = replace(
        world,
        id=name,
        width=32,
        height=32,
        image_start=image_start,
        context_noise=context_noise,
    )
    plugin = TinyWorldPlugin(TinyWorldSettings(carry_channels=carry)) if carry else None
    w = build_world(world, dit, vae, seed=0, plugin=plugin)
    if image_start:
        gen = torch.Generator().manual_seed(0)

        def start_image(seed: int):
            g = torch.Generator().manual_seed(seed)
            return torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8).numpy()

        w._start_image = start_image
        del gen
    return w


@pytest.fixture(scope="session")
def world() -> World:
    return small_world()


@pytest.fixture(scope="session")
def image_world() -> World:
    return small_world(image_start=True, name="tiny-image")


def close_frames(a: np.ndarray, b: np.ndarray) -> bool:
    """The same frames up to one intensity level: a stream batched with others and the same
    stream alone differ only by fp32 summation order, which the CPU kernels pick by batch size
    and memory alignment."""
    return a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 1


def keys(*names: str) -> list[FrameAction]:
    """One action for the whole chunk."""
    return [FrameAction(frozenset(names))]


def run_chunk(engine: Engine, stream_id: str, actions: list[FrameAction] | None = None) -> list[Outcome]:
    """Submit one chunk and step until the engine is idle; returns every outcome."""
    engine.submit(ChunkRequest(stream_id, engine.new_request_id(), actions=actions))
    outcomes: list[Outcome] = []
    while engine.has_work():
        outcomes += engine.step()
    return outcomes


def committed(engine: Engine, stream_id: str, actions: list[FrameAction] | None = None) -> ChunkCommitted:
    """Run one chunk that must commit."""
    (out,) = [o for o in run_chunk(engine, stream_id, actions) if o.stream_id == stream_id]
    assert isinstance(out, ChunkCommitted), out
    return out


def snapshot(engine: Engine, stream_id: str) -> dict:
    """Everything committed about a stream: counters, attended K/V, decoder cache, action log."""
    stream = engine.runner.streams[stream_id]
    st = stream.state
    world = engine.worlds[stream.model_id]
    layout = engine.runner.layouts[stream.model_id]
    n_next = st.start_latents.shape[1] if st.start_latents is not None else world.chunk_frames
    view = layout.committed_view(world.transformer.pool, st.row, st.frames, n_next)
    return {
        "counters": (st.chunks, st.frames, st.video_frames, st.seed),
        "kv": {k: v.clone() for k, v in view.items()},
        "decoder": [f.clone() if isinstance(f, torch.Tensor) else f for f in st.decoder.feats],
        "decoder_frames": st.decoder.frames,
        "log": len(stream.action_log),
        "start": None if st.start_latents is None else st.start_latents.clone(),
    }


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a["counters"] == b["counters"]
    assert a["decoder_frames"] == b["decoder_frames"]
    assert a["log"] == b["log"]
    for name in a["kv"]:
        assert torch.equal(a["kv"][name], b["kv"][name]), name
    for x, y in zip(a["decoder"], b["decoder"], strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert (a["start"] is None) == (b["start"] is None)
    if a["start"] is not None:
        assert torch.equal(a["start"], b["start"])

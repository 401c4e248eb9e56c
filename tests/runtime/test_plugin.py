"""The plug-in seam in the chunk loop, with a plug-in that is not the tiny world's: its actions
reach the DiT, its pin lands in every clean estimate, its noise hook sees every draw, and its
per-session state starts at the prefill, moves only when a chunk commits (a cancelled chunk
leaves it), is shared by a fork and dropped by a reset."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.plugin import ChunkPlan, WorldPlugin
from models.world import Conditioning, World
from runtime.engine import Engine
from runtime.requests import ChunkCancelled
from tests.runtime.conftest import committed, keys, run_chunk, small_world


@dataclass(frozen=True)
class Count:
    """A toy state: chunks seen, and the mean of the latest committed latents."""

    chunks: int
    mean: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.mean.numel() * self.mean.element_size()


class Recorder(WorldPlugin):
    """Counts chunks, pins channel 0 to `PIN`, zeroes the noise of channel 1, and records what
    its hooks were given."""

    name = "recorder"
    PIN = 0.25

    def __init__(self) -> None:
        self.planned: list[list[Count | None]] = []
        self.noised = 0

    def bind(self, world: World) -> None:
        self.channels = world.latent_shape[0]

    def start(self, latents: torch.Tensor) -> Count:
        return Count(0, latents.mean())

    def plan(self, actions: torch.Tensor | None, states: Sequence[Any]) -> ChunkPlan:
        self.planned.append(list(states))

        def pin(x: torch.Tensor) -> torch.Tensor:
            x[:, 0] = self.PIN
            return x

        return ChunkPlan(actions, pin)

    def noise(self, noise: torch.Tensor, states: Sequence[Any]) -> torch.Tensor:
        self.noised += 1
        noise[:, 1] = 0.0
        return noise

    def advance(
        self, raw: torch.Tensor, shown: torch.Tensor, states: Sequence[Any], entries: Sequence[int]
    ) -> dict[int, Count]:
        return {i: Count(states[i].chunks + 1, shown[i].mean()) for i in entries}

    def state_bytes(self) -> int:
        return 4

    def save(self, root: Path) -> dict[str, Any]:
        return {"name": self.name}


def recording_world() -> tuple[World, Recorder]:
    world = small_world(image_start=True, name="rec")
    plugin = Recorder()
    world.set_plugin(plugin)
    return world, plugin


def test_the_hooks_shape_the_chunk_and_the_state_moves_at_commit(monkeypatch):
    world, plugin = recording_world()
    clean = []
    context = world.context

    def record(x0, index, actions, noise=None):
        clean.append(x0.clone())
        return context(x0, index, actions, noise=noise)

    monkeypatch.setattr(world, "context", record)
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=2))
    st = engine.runner.streams["s"].state
    assert st.plugin_state == Count(0, st.plugin_state.mean)  # the prefill's start
    committed(engine, "s", keys("d"))
    committed(engine, "s", None)
    assert st.plugin_state.chunks == 2
    assert [s[0].chunks for s in plugin.planned] == [0, 1]  # each chunk saw the committed state
    assert plugin.noised == 2 * len(world.config.schedule.steps)  # re-noised: a draw per step
    # The pin holds in the clean estimate every chunk committed (its channel 0).
    for x0 in clean[1:]:
        assert torch.all(x0[:, 0] == Recorder.PIN)
    assert not torch.all(clean[1][:, 1] == Recorder.PIN)
    assert world.session_bytes() == world.kv_bytes_per_session() + 2 * 4


def test_a_cancelled_chunk_leaves_the_state_and_a_fork_shares_it():
    world, _ = recording_world()
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=2))
    committed(engine, "s", None)
    st = engine.runner.streams["s"].state
    before = st.plugin_state

    def hook(stream_id: str, name: str) -> None:
        if name == "decode":
            engine.abort(engine._live)

    engine.runner.boundary_hook = hook
    assert [type(o) for o in run_chunk(engine, "s", None)] == [ChunkCancelled]
    assert st.plugin_state is before
    engine.runner.boundary_hook = None
    engine.fork_stream("s", "f")
    assert engine.runner.streams["f"].state.plugin_state is before
    committed(engine, "f", None)
    assert st.plugin_state is before and engine.runner.streams["f"].state.plugin_state.chunks == 2
    engine.reset_stream("s", Conditioning(seed=3))
    assert engine.runner.streams["s"].state.plugin_state.chunks == 0

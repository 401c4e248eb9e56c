"""Batched rollouts for data: many episodes through one server, recorded in the episode format.

``concurrency`` workers each hold one lockstep session and run episodes one after another
(episode ``i`` is world seed ``seed + i``); their steps reach the server's engine together, so it
batches them. A finished episode (its ``meta.json`` exists) is skipped, so a rollout that was
stopped picks up where it left off.

Policies: ``random`` samples the action space (seeded per episode), ``script:FILE`` loads a
Python file that defines ``policy(obs, t, action_space) -> action`` (``obs`` the latest frame
(H, W, 3) uint8, ``t`` the step within the episode, ``action_space`` the env's gym space, seeded
per episode; the action as for :class:`~web.sdk.gym_env.WorldEnv`).
"""

import asyncio
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from web import messages as m
from web.sdk.gym_env import EnvSession, lockstep_open
from web.sdk.record import EpisodeWriter, VideoFormat, episode_meta, is_complete
from web.sdk.spaces import action_space

__all__ = ["Policy", "RolloutResult", "episode_dir", "load_policy", "rollout"]

Policy = Callable[[np.ndarray, int, spaces.Dict], Any]


def _random(obs: np.ndarray, t: int, space: spaces.Dict) -> Any:
    return space.sample()


def load_policy(spec: str) -> Policy:
    """``random`` or ``script:FILE`` (a Python file defining ``policy``)."""
    if spec == "random":
        return _random
    if spec.startswith("script:"):
        path = Path(spec.removeprefix("script:"))
        module_spec = importlib.util.spec_from_file_location(f"worldserve_policy_{path.stem}", path)
        if module_spec is None or module_spec.loader is None or not path.is_file():
            raise ValueError(f"cannot load policy script {path}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        policy = getattr(module, "policy", None)
        if not callable(policy):
            raise ValueError(f"{path} defines no function `policy(obs, t, action_space)`")
        return policy
    raise ValueError(f"--policy must be 'random' or 'script:FILE', got {spec!r}")


def episode_dir(out: Path, i: int) -> Path:
    return out / f"episode-{i:05d}"


@dataclass(frozen=True)
class RolloutResult:
    """What a rollout did."""

    episodes: int  # episodes run now
    skipped: int  # episodes already complete
    frames: int  # frames generated now
    seconds: float

    def summary(self) -> str:
        """The CLI's summary line."""
        rate = self.seconds or float("nan")
        return (
            f"rollout: {self.episodes} episodes ({self.skipped} already done), {self.frames} frames "
            f"in {self.seconds:.1f} s: {self.episodes / rate:.2f} episodes/s, "
            f"{self.frames / rate:.1f} frames/s"
        )


async def rollout(
    url: str,
    out: Path,
    *,
    episodes: int,
    steps: int,
    policy: Policy,
    concurrency: int = 8,
    model: str | None = None,
    seed: int = 0,
    video: VideoFormat = "npz",
    token: str | None = None,
    on_step: Callable[[int], None] | None = None,
) -> RolloutResult:
    """Run ``episodes`` episodes of ``steps`` chunks each into ``out``; ``on_step(frames)`` after
    every chunk (a progress bar)."""
    if episodes < 0 or steps < 1 or concurrency < 1:
        raise ValueError(
            f"need episodes >= 0, steps >= 1, concurrency >= 1; got {episodes}, {steps}, {concurrency}"
        )
    todo = [i for i in range(episodes) if not is_complete(episode_dir(out, i))]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in todo:
        queue.put_nowait(i)
    frames = 0
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal frames
        world = EnvSession(url, lockstep_open(model, "raw", token, None), "frame", per_frame=False)
        await world.open()
        assert world.model is not None
        space = action_space(world.model.action_space)
        try:
            while not queue.empty():
                i = queue.get_nowait()
                made = await _episode(world, space, i, seed + i, steps, policy, out, video, on_step)
                frames += made  # after the await: `frames += await ...` would read `frames` before it
        finally:
            await world.close()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(todo)))))
    return RolloutResult(len(todo), episodes - len(todo), frames, time.perf_counter() - started)


async def _episode(
    world: EnvSession,
    space: spaces.Dict,
    i: int,
    world_seed: int,
    steps: int,
    policy: Policy,
    out: Path,
    video: VideoFormat,
    on_step: Callable[[int], None] | None,
) -> int:
    obs, _ = await world.reset(world_seed, None)
    ready: m.Ready = world.durable.ready
    meta = episode_meta(ready, world.url, world_seed, None, per_frame=False)
    writer = EpisodeWriter(episode_dir(out, i), meta, None, video)
    space.seed(world_seed)
    for t in range(steps):
        wire = world.wire(policy(obs, t, space))
        obs, info = await world.step(wire)
        assert world.last_chunk is not None
        writer.add(info["chunk"], info["frame0"], world.last_chunk.frames, wire)
        if on_step is not None:
            on_step(info["frames"])
    writer.close()
    return writer.frames

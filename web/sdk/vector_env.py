"""``WorldVectorEnv``: N worldserve sessions as one Gymnasium 1.x ``VectorEnv``, batched on the server.

    envs = gym.make_vec("worldserve/World-v0", num_envs=8, vectorization_mode="vector_entry_point",
                        url="127.0.0.1:8000", max_episode_steps=100)

All N sessions live on one event loop (:class:`~web.sdk.loop.LoopThread`), and ``step`` sends
every env's ``step`` message before it awaits any reply, so they reach the server's engine
together and it batches them into one forward (up to the server's ``--max-batch``). Env ``i``
behaves exactly like a :class:`~web.sdk.gym_env.WorldEnv` reset with the same seed and stepped
with the same actions: ``reset(seed=s)`` seeds env ``i`` with ``s + i``.

A server error in one env (e.g. ``internal`` for a chunk the model failed on) is raised once
every env's step has finished; the other envs did step, so nothing is sent twice.

Autoreset mode: ``NEXT_STEP`` (Gymnasium's default). After env ``i`` ends an episode (truncated
at ``max_episode_steps``), the next ``step`` ignores its action and resets it instead: its
observation is the new world's first frame, reward 0, terminated and truncated False.
"""

import asyncio
from typing import Any, ClassVar

import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, iterate

from web import messages as m
from web.sdk.gym_env import MAX_SEED, EnvSession, RewardFn, lockstep_open, reset_options
from web.sdk.loop import LoopThread
from web.sdk.spaces import ObsMode, action_space, observation_space

__all__ = ["WorldVectorEnv"]


async def _gather(*coros: Any, return_exceptions: bool = False) -> list[Any]:
    """``asyncio.gather`` as a coroutine, for :meth:`LoopThread.run` (on the loop, every send goes
    out before any reply is awaited)."""
    return await asyncio.gather(*coros, return_exceptions=return_exceptions)


class WorldVectorEnv(VectorEnv):
    """N lockstep sessions of one world, stepped together (arguments as for ``WorldEnv``)."""

    metadata: ClassVar[dict[str, Any]] = {
        "render_modes": ["rgb_array"],
        "autoreset_mode": AutoresetMode.NEXT_STEP,
    }

    def __init__(
        self,
        num_envs: int,
        url: str = "127.0.0.1:8000",
        model: str | None = None,
        *,
        codec: m.Codec = "raw",
        obs: ObsMode = "frame",
        per_frame: bool = False,
        max_episode_steps: int | None = None,
        reward_fn: RewardFn | None = None,
        render_mode: str | None = None,
        token: str | None = None,
        debug: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        timings: bool = False,
    ) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.num_envs = num_envs
        self.render_mode = render_mode
        self.max_episode_steps = max_episode_steps
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.timings = timings
        self._loop = LoopThread()
        msg = lockstep_open(model, codec, token, debug)
        self.worlds = [EnvSession(url, msg, obs, per_frame) for _ in range(num_envs)]
        try:
            self._run(_gather(*(w.open() for w in self.worlds)))
        except BaseException:
            self._close_worlds()
            raise
        info = self.worlds[0].model
        assert info is not None
        self.metadata = {**self.metadata, "render_fps": info.fps}
        self.single_observation_space = observation_space(info, obs)
        self.single_action_space = action_space(info.action_space, info.chunk_frames if per_frame else None)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._rngs = [seeding.np_random()[0] for _ in range(num_envs)]  # per env, as WorldEnv.np_random
        self._autoreset = np.zeros(num_envs, np.bool_)
        self._obs: list[np.ndarray] = []

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro, self.timeout_s)

    def _world_seed(self, i: int) -> int:
        return int(self._rngs[i].integers(MAX_SEED))

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset every env (or those in ``options["reset_mask"]``): ``seed`` None, an int (env
        ``i`` gets ``seed + i``) or one per env; ``options["image"]``: start image for all."""
        super().reset(seed=seed if isinstance(seed, int) else None)
        seeds = [seed + i for i in range(self.num_envs)] if isinstance(seed, int) else seed
        seeds = seeds or [None] * self.num_envs
        if len(seeds) != self.num_envs:
            raise ValueError(f"{len(seeds)} seeds for {self.num_envs} envs")
        options = dict(options or {})
        mask = np.asarray(options.pop("reset_mask", np.ones(self.num_envs, np.bool_)), np.bool_)
        if mask.shape != (self.num_envs,):
            raise ValueError(f"options['reset_mask'] must have shape ({self.num_envs},), got {mask.shape}")
        image = reset_options(options)
        jobs = {}
        for i in np.flatnonzero(mask):
            if seeds[i] is not None:
                self._rngs[i] = seeding.np_random(seeds[i])[0]
            world_seed = seeds[i] if seeds[i] is not None else self._world_seed(i)
            jobs[int(i)] = self.worlds[i].reset(world_seed, image)
        results = self._run(_gather(*jobs.values()))
        if not self._obs:
            self._obs = [np.zeros(self.single_observation_space.shape, np.uint8)] * self.num_envs
        infos: dict[str, Any] = {}
        for i, (obs, info) in zip(jobs, results, strict=True):
            self._obs[i] = obs
            self._autoreset[i] = False
            infos = self._add_info(infos, info, i)
        return np.stack(self._obs), infos

    def step(
        self, actions: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """One chunk in every env, sent together; envs that ended last step are reset instead."""
        per_env = list(iterate(self.action_space, actions))
        if len(per_env) != self.num_envs:
            raise ValueError(f"{len(per_env)} actions for {self.num_envs} envs")
        wires = [
            None if self._autoreset[i] else self.worlds[i].wire(per_env[i]) for i in range(self.num_envs)
        ]  # every ValueError before anything is sent
        jobs = [
            w.reset(self._world_seed(i), w.image) if wire is None else w.step(wire)
            for i, (w, wire) in enumerate(zip(self.worlds, wires, strict=True))
        ]
        results = self._run(_gather(*jobs, return_exceptions=True))
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # every other env did step (its new frame is its next observation)
            for i, r in enumerate(results):
                if not isinstance(r, BaseException):
                    self._obs[i] = r[0]
            raise failed[0]
        rewards = np.zeros(self.num_envs, np.float64)
        truncations = np.zeros(self.num_envs, np.bool_)
        infos: dict[str, Any] = {}
        for i, ((obs, info), wire) in enumerate(zip(results, wires, strict=True)):
            self._obs[i] = obs
            if wire is not None:
                if not self.timings:
                    del info["timings"]
                if self.reward_fn is not None:
                    rewards[i] = float(self.reward_fn(obs, per_env[i], info))
                steps = self.worlds[i].steps
                truncations[i] = self.max_episode_steps is not None and steps >= self.max_episode_steps
            infos = self._add_info(infos, info, i)
        self._autoreset = truncations.copy()
        return np.stack(self._obs), rewards, np.zeros(self.num_envs, np.bool_), truncations, infos

    def render(self) -> tuple[np.ndarray, ...] | None:
        """Every env's latest frame, for ``render_mode="rgb_array"``."""
        if self.render_mode != "rgb_array":
            return None
        return tuple(np.zeros_like(self._obs[0]) if w.frame is None else w.frame.copy() for w in self.worlds)

    def _close_worlds(self) -> None:
        try:
            self._run(_gather(*(w.close() for w in self.worlds), return_exceptions=True))
        finally:
            self._loop.close()

    def close_extras(self, **kwargs: Any) -> None:
        """Close every session and the event loop."""
        if not self._loop.loop.is_closed():
            self._close_worlds()

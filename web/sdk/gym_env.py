"""``WorldEnv``: a Gymnasium environment over a lockstep session of a running worldserve server.

    import gymnasium as gym
    import web.sdk.gym_env  # registers worldserve/World-v0

    env = gym.make("worldserve/World-v0", url="127.0.0.1:8000", max_episode_steps=100)
    obs, info = env.reset(seed=0)                      # (H, W, 3) uint8
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())

One ``step`` is one chunk. ``reset(seed=s)`` starts world seed ``s`` (the world ``worldserve
generate --seed s`` makes); ``reset()`` draws the world seed from the env's seeded RNG. Its
observation is the world's current frame: an image-started world's start frame, otherwise zeros
(nothing is generated before the first step). ``options={"image": (H, W, 3) uint8}`` starts an
image-conditioned world from that frame (a new session). A learned simulator has no reward:
``reward_fn(obs, action, info)`` supplies one (default 0.0); episodes end by truncation only,
at ``max_episode_steps``. A dropped socket is resumed transparently (:mod:`web.sdk.durable`).
``step``'s info holds ``chunk``, ``frame0`` and ``frames``; ``timings=True`` adds ``timings``
(the server's ms per stage). They are opt-in because they differ from run to run: with them,
equal seeds and actions no longer give equal infos, and gymnasium's ``check_env`` fails.
Needs the ``gym`` extra (``pip install -e '.[gym]'``).
"""

from collections.abc import Callable
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded

from web import messages as m
from web.sdk.durable import DurableSession
from web.sdk.loop import LoopThread
from web.sdk.spaces import ObsMode, action_space, observation, observation_space, to_wire
from web.sdk.types import Chunk

__all__ = ["ENV_ID", "MAX_SEED", "EnvSession", "RewardFn", "WorldEnv", "start_frame"]

ENV_ID = "worldserve/World-v0"
MAX_SEED = 2**63 - 1
RewardFn = Callable[[np.ndarray, Any, dict[str, Any]], float]


def start_frame(ready: m.Ready) -> np.ndarray | None:
    """The start frame ``ready`` carries for an image-started world, as a fresh (H, W, 3) uint8
    array (None for other worlds: they have no frame before their first chunk)."""
    return None if ready.frame is None else np.array(ready.frame, dtype=np.uint8)


class EnvSession:
    """One world's episode bookkeeping over a :class:`DurableSession` (shared by both gym envs):
    turns gym actions into protocol actions and chunks into observations."""

    def __init__(self, url: str, open_msg: m.Open, obs: ObsMode, per_frame: bool) -> None:
        self.url = url
        self.open_msg = open_msg
        self.obs = obs
        self.per_frame = per_frame
        self.durable = DurableSession(url, open_msg)
        self.model: m.ModelInfo | None = None
        self.frame: np.ndarray | None = None  # the latest frame, (H, W, 3)
        self.frames_seen = 0  # video frames of this world so far (a start frame counts)
        self.steps = 0  # chunks stepped in this episode
        self.chunk_base = 0  # the session's chunk number before this world's first chunk
        self.seed: int | None = None  # this world's seed
        self.image: np.ndarray | None = None  # the start image this world was opened with
        self.last_chunk: Chunk | None = None
        self.last_actions: tuple[m.FrameAction, ...] = ()

    async def open(self) -> m.Ready:
        ready = await self.durable.open()
        self.model = ready.model
        return ready

    def wire(self, action: Any) -> tuple[m.FrameAction, ...]:
        """Protocol actions for the next chunk (ValueError for an action outside the space). A
        world's very first chunk can be shorter than ``chunk_frames``: per-frame actions send
        their first entry for all of its frames."""
        assert self.model is not None
        frames = self.model.chunk_frames if self.per_frame else None
        wire = to_wire(action, self.model.action_space, frames)
        return wire[:1] if self.frames_seen == 0 else wire

    async def reset(self, seed: int, image: np.ndarray | None) -> tuple[np.ndarray, dict[str, Any]]:
        """A fresh world with this seed (a new session when a start image is involved)."""
        if image is not None or self.image is not None:
            await self.durable.close()
            msg = m.Open(**{**dict(self.open_msg), "seed": seed, "image": image})
            self.durable = DurableSession(self.url, msg)
            ready = await self.open()
        else:
            ready = await self.durable.reset(seed)
        self.seed, self.image, self.steps, self.chunk_base = seed, image, 0, ready.chunk
        self.last_chunk, self.last_actions = None, ()
        start = start_frame(ready)
        self.frames_seen = 0 if start is None else 1
        assert self.model is not None
        self.frame = np.zeros((self.model.height, self.model.width, 3), np.uint8) if start is None else start
        info = {"world_seed": seed, "chunk": ready.chunk, "session_id": ready.session_id}
        return observation(self.frame[None], self.obs, self.model.chunk_frames), info

    async def step(self, wire: tuple[m.FrameAction, ...]) -> tuple[np.ndarray, dict[str, Any]]:
        """One chunk; its observation and info: ``chunk`` and ``frame0`` count within this world
        (from 1 and 0; an image-started world's start frame is frame 0), ``frames`` (video frames
        in the chunk), ``timings`` (server ms per stage; the envs drop it unless asked for)."""
        assert self.model is not None
        chunk = await self.durable.step(wire)
        info = {
            "chunk": chunk.chunk - self.chunk_base,
            "frame0": self.frames_seen,
            "frames": len(chunk.frames),
            "timings": chunk.timings,
        }
        self.steps += 1
        self.frames_seen += len(chunk.frames)
        self.frame = chunk.frames[-1]
        self.last_chunk, self.last_actions = chunk, wire
        return observation(chunk.frames, self.obs, self.model.chunk_frames), info

    async def close(self) -> None:
        await self.durable.close()


def lockstep_open(
    model: str | None, codec: m.Codec, token: str | None, debug: dict[str, Any] | None
) -> m.Open:
    """The `open` of a gym env's session (lockstep; the seed comes with reset)."""
    hooks = None if debug is None else m.DebugHooks(**debug)
    return m.Open(model=model, mode="lockstep", codec=codec, token=token, debug=hooks)


def reset_options(options: dict[str, Any] | None) -> np.ndarray | None:
    """The start image from ``reset(options=...)`` (ValueError for unknown options)."""
    options = dict(options or {})
    image = options.pop("image", None)
    if options:
        raise ValueError(f"unknown reset options {sorted(options)}; the only option is 'image'")
    return None if image is None else np.ascontiguousarray(image, dtype=np.uint8)


class WorldEnv(gym.Env[np.ndarray, dict[str, np.ndarray]]):
    """A worldserve world as a ``gymnasium.Env``: one step is one lockstep chunk.

    ``obs="frame"`` observes the chunk's last frame (H, W, 3); ``obs="chunk"`` the whole chunk
    (chunk_frames, H, W, 3). ``per_frame=True`` takes one action per video frame (a leading
    ``chunk_frames`` axis) instead of one for the whole chunk. The session is opened here (the
    spaces come from the world's ``ready``); ``timeout_s`` bounds every call (None: no limit).
    ``timings=True`` adds the server's ms per stage to ``step``'s info; off by default, since
    they differ from run to run and gymnasium's ``check_env`` wants equal infos for equal seeds.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 15}

    def __init__(
        self,
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
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.render_mode = render_mode
        self.max_episode_steps = max_episode_steps
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.timings = timings
        self._loop = LoopThread()
        self.world = EnvSession(url, lockstep_open(model, codec, token, debug), obs, per_frame)
        try:
            self._run(self.world.open())
        except BaseException:
            self._loop.close()
            raise
        self._started = False
        info = self.world.model
        assert info is not None
        self.metadata = {**self.metadata, "render_fps": info.fps}
        self.observation_space = observation_space(info, obs)
        self.action_space = action_space(info.action_space, info.chunk_frames if per_frame else None)

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro, self.timeout_s)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start a world: seed ``seed``, or one drawn from the env's RNG; ``options["image"]``:
        start from that frame. Returns the world's current frame and info (world_seed, chunk)."""
        super().reset(seed=seed)
        image = reset_options(options)
        world_seed = seed if seed is not None else int(self.np_random.integers(MAX_SEED))
        obs, info = self._run(self.world.reset(world_seed, image))
        self._started = True
        return obs, info

    def step(self, action: dict[str, np.ndarray]) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One chunk: ``(obs, reward, terminated, truncated, info)``; info has chunk, frame0,
        frames (video frames in the chunk), and timings (server ms per stage) if ``timings``."""
        if not self._started:
            raise ResetNeeded("call reset() before step()")
        wire = self.world.wire(action)  # ValueError before anything is sent
        obs, info = self._run(self.world.step(wire))
        if not self.timings:
            del info["timings"]
        reward = 0.0 if self.reward_fn is None else float(self.reward_fn(obs, action, info))
        truncated = self.max_episode_steps is not None and self.world.steps >= self.max_episode_steps
        return obs, reward, False, truncated, info

    def render(self) -> np.ndarray | None:  # type: ignore[override]
        """The world's latest frame (H, W, 3) for ``render_mode="rgb_array"``."""
        if self.render_mode != "rgb_array" or self.world.frame is None:
            return None
        return self.world.frame.copy()

    def close(self) -> None:
        """Close the session and the env's event loop."""
        if not self._loop.loop.is_closed():
            try:
                self._run(self.world.close())
            finally:
                self._loop.close()
        super().close()


gym.register(ENV_ID, entry_point=WorldEnv, vector_entry_point="web.sdk.vector_env:WorldVectorEnv")

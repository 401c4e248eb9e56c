"""web/sdk/gym_env: WorldEnv against a live loopback server over the tiny test worlds."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from web.errors import ErrorCode, ServerError
from web.sdk.gym_env import ENV_ID, WorldEnv

ACTION = {"keys": np.array([1, 0, 0, 1, 0], np.int8), "mouse": np.array([0.5, -1.0], np.float32)}


def test_gym_modules_import_without_torch() -> None:
    probe = (
        "import sys, web.sdk.gym_env, web.sdk.vector_env, web.sdk.record, web.sdk.replay, web.sdk.rollout; "
        "banned = {'torch', 'sessions', 'runtime', 'models', 'diffusers'}; "
        "print(sorted(banned & {name.split('.')[0] for name in sys.modules}))"
    )
    root = Path(__file__).parents[3]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


# What check_env may still say about a default env: gymnasium's advice, not a failed check. The
# first comes with any env from gym.make (it checks through the wrappers, which is the point
# here); the second because mouse and vector are the protocol's +-1e4 units, not normalized.
ADVISORIES = ("is different from the unwrapped version", "recommend using a symmetric and normalized space")


@pytest.mark.parametrize("unwrapped", [False, True])
def test_check_env_passes_with_default_arguments(server, unwrapped: bool) -> None:
    env = gym.make(ENV_ID, url=server.url)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped if unwrapped else env)  # render and close checks included
        unexpected = [str(w.message) for w in caught if not any(a in str(w.message) for a in ADVISORIES)]
        assert unexpected == []
    finally:
        env.close()


def test_timings_are_opt_in(server) -> None:
    plain, timed = WorldEnv(server.url), WorldEnv(server.url, timings=True)
    try:
        for env in (plain, timed):
            env.reset(seed=1)
        assert "timings" not in plain.step(ACTION)[4]
        assert "denoise" in timed.step(ACTION)[4]["timings"]
    finally:
        plain.close()
        timed.close()


def test_make_spaces_reset_step_render(server) -> None:
    env = gym.make(ENV_ID, url=server.url, render_mode="rgb_array", max_episode_steps=2)
    try:
        assert env.observation_space == gym.spaces.Box(0, 255, (32, 32, 3), np.uint8)
        assert set(env.action_space.spaces) == {"keys", "mouse", "vector"}
        assert env.action_space["keys"].n == (5,) and env.action_space["vector"].shape == (2,)
        obs, info = env.reset(seed=4)
        assert not obs.any() and info["world_seed"] == 4  # nothing generated yet: zeros
        obs, reward, terminated, truncated, info = env.step(ACTION)
        assert obs.shape == (32, 32, 3) and obs.any() and reward == 0.0
        assert (terminated, truncated) == (False, False)
        assert (info["chunk"], info["frame0"], info["frames"]) == (1, 0, 3)
        np.testing.assert_array_equal(env.render(), obs)
        _, _, _, truncated, info = env.step(ACTION)
        assert truncated and (info["chunk"], info["frame0"]) == (2, 3)
        # a second world in the same session counts its chunks from 1 again
        env.reset(seed=4)
        assert env.step(ACTION)[4]["chunk"] == 1
    finally:
        env.close()


def test_chunk_observations_per_frame_actions_and_reward(server) -> None:
    seen = []

    def reward_fn(obs, action, info):
        seen.append(info["chunk"])
        return float(obs.mean())

    env = WorldEnv(server.url, obs="chunk", per_frame=True, reward_fn=reward_fn)
    try:
        assert env.observation_space.shape == (4, 32, 32, 3)
        assert env.action_space["keys"].n == (4, 5) and env.action_space["mouse"].shape == (4, 2)
        env.reset(seed=1)
        first, reward, *_ = env.step(env.action_space.sample())
        # the world's first chunk has 3 frames: padded at the front with its first frame
        np.testing.assert_array_equal(first[0], first[1])
        assert reward == pytest.approx(first.mean())
        frames = env.step({"keys": np.eye(4, 5, dtype=np.int8)})[0]
        assert frames.shape == (4, 32, 32, 3) and seen == [1, 2]
        assert env.world.last_actions[1].keys == ("a",) and env.world.last_actions[3].keys == ("d",)
    finally:
        env.close()


def test_reset_seed_is_the_world_seed(server) -> None:
    a, b = WorldEnv(server.url), WorldEnv(server.url)
    try:
        a.reset(seed=9)
        b.reset(seed=9)
        np.testing.assert_array_equal(a.step(ACTION)[0], b.step(ACTION)[0])
        b.reset(seed=10)
        a.reset(seed=9)
        assert not np.array_equal(a.step(ACTION)[0], b.step(ACTION)[0])
        # reset() without a seed draws one from the env's seeded RNG
        a.reset(seed=3)
        first = a.reset()[1]["world_seed"]
        a.reset(seed=3)
        assert a.reset()[1]["world_seed"] == first
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("action", "field"),
    [
        ({"keys": np.array([2, 0, 0, 0, 0])}, "keys"),
        ({"keys": np.zeros(4)}, "keys"),
        ({"mouse": np.array([np.nan, 0.0])}, "mouse"),
        ({"mouse": np.array([2e4, 0.0])}, "mouse"),
        ({"vector": np.zeros(3)}, "vector"),
        ({"jump": 1}, "jump"),
    ],
)
def test_action_outside_the_space_is_a_value_error_before_sending(server, action, field) -> None:
    env = WorldEnv(server.url)
    try:
        env.reset(seed=0)
        session = env.world.durable.session
        sent = []
        send = session.send

        async def spy(msg):
            sent.append(msg)
            await send(msg)

        session.send = spy
        with pytest.raises(ValueError, match=f"'{field}'"):
            env.step(action)
        assert sent == []
        env.step(ACTION)  # the session is intact
        assert [type(msg).__name__ for msg in sent] == ["Step", "Ack"]
    finally:
        env.close()


def test_server_errors_carry_the_protocol_code(server) -> None:
    with pytest.raises(ServerError) as info:
        WorldEnv(server.url, model="no-such-world")
    assert info.value.code is ErrorCode.NOT_FOUND
    env = WorldEnv(server.url, debug={"fail_at_chunk": 2})
    try:
        env.reset(seed=0)
        env.step(ACTION)
        with pytest.raises(ServerError) as info:
            env.step(ACTION)
        assert info.value.code is ErrorCode.INTERNAL and not info.value.fatal
        assert env.step(ACTION)[4]["chunk"] == 2  # rolled back; the session goes on
    finally:
        env.close()


def test_step_before_reset_and_bad_options(server) -> None:
    env = WorldEnv(server.url)
    try:
        with pytest.raises(gym.error.ResetNeeded):
            env.step(ACTION)
        with pytest.raises(ValueError, match="unknown reset options"):
            env.reset(options={"prompt": "x"})
    finally:
        env.close()


def test_image_started_world_observes_its_start_frame(server) -> None:
    env = WorldEnv(server.url, model="tiny-image", per_frame=True)
    try:
        obs, info = env.reset(seed=2)
        start = server.manager.get(info["session_id"]).frame
        assert start is not None and start.any()
        np.testing.assert_array_equal(obs, start)
        _, _, _, _, info = env.step({"keys": np.zeros((4, 5), np.int8)})  # a full chunk of 4 actions
        assert (info["chunk"], info["frame0"], info["frames"]) == (1, 1, 4)
        image = np.full((32, 32, 3), 200, np.uint8)
        obs, info = env.reset(seed=2, options={"image": image})  # a new session from this image
        np.testing.assert_array_equal(obs, server.manager.get(info["session_id"]).frame)
        assert env.step({})[4]["frame0"] == 1
    finally:
        env.close()

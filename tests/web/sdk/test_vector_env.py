"""web/sdk/vector_env: WorldVectorEnv matches single envs frame for frame, autoresets NEXT_STEP."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import web.sdk.gym_env  # noqa: F401 - registers worldserve/World-v0
from web.errors import ErrorCode, ServerError
from web.sdk.gym_env import EnvSession, WorldEnv, lockstep_open
from web.sdk.vector_env import WorldVectorEnv

N = 8
STEPS = 3  # with max_episode_steps=2: two steps, then an autoreset


def assert_same_frame(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal frames, up to the engine's batching: a forward over 8 sessions is not bit-identical
    to 8 forwards of one on CPU (matmul blocking), which moves a rare value by one level."""
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= 1 and np.count_nonzero(diff) <= got.size // 1000, (what, diff.max())


def test_vector_of_8_matches_8_single_envs(server) -> None:
    envs = gym.make_vec(
        "worldserve/World-v0",
        num_envs=N,
        vectorization_mode="vector_entry_point",
        url=server.url,
        max_episode_steps=2,
    )
    assert isinstance(envs.unwrapped, WorldVectorEnv)
    assert envs.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
    envs.action_space.seed(5)
    actions = [envs.action_space.sample() for _ in range(STEPS)]
    try:
        obs, _ = envs.reset(seed=100)
        got = [obs]
        truncs = []
        for a in actions:
            obs, _, _, truncs_t, _ = envs.step(a)
            got.append(obs)
            truncs.append(truncs_t)
    finally:
        envs.close()
    assert got[1].shape == (N, 32, 32, 3)
    assert [t.tolist() for t in truncs] == [[False] * N, [True] * N, [False] * N]
    for i in range(N):
        env = WorldEnv(server.url, max_episode_steps=2)
        try:
            want = [env.reset(seed=100 + i)[0]]
            for t, a in enumerate(actions):
                single = {k: v[i] for k, v in a.items()}
                want.append(env.reset()[0] if t == 2 else env.step(single)[0])  # NEXT_STEP autoreset
        finally:
            env.close()
        for t in range(STEPS + 1):
            assert_same_frame(got[t][i], want[t], f"env {i}, step {t}")
    # the envs really differ from each other (different seeds)
    assert len({got[2][i].tobytes() for i in range(N)}) == N


def test_reset_mask_and_bad_actions() -> None:
    with pytest.raises(ValueError, match="num_envs"):
        WorldVectorEnv(0)


def test_bad_action_in_one_env_sends_nothing(server) -> None:
    envs = WorldVectorEnv(2, server.url)
    try:
        envs.reset(seed=0)
        actions = envs.action_space.sample()
        actions["mouse"][1, 0] = np.inf
        with pytest.raises(ValueError, match="'mouse'"):
            envs.step(actions)
        obs, *_, infos = envs.step(envs.action_space.sample())
        assert infos["chunk"].tolist() == [1, 1]  # the refused step made no chunk anywhere
        obs2, infos2 = envs.reset(seed=7, options={"reset_mask": np.array([False, True])})
        assert infos2["_world_seed"].tolist() == [False, True] and infos2["world_seed"][1] == 8
        np.testing.assert_array_equal(obs2[0], obs[0])
        assert not obs2[1].any()
    finally:
        envs.close()


def test_a_server_error_in_one_env_leaves_the_others_stepped(server) -> None:
    envs = WorldVectorEnv(2, server.url, timings=False)
    try:
        # env 1's model fails its second chunk (a debug hook); env 0 is fine
        envs._run(envs.worlds[1].close())
        hooked = lockstep_open(None, "raw", None, {"fail_at_chunk": 2})
        envs.worlds[1] = EnvSession(server.url, hooked, "frame", per_frame=False)
        envs._run(envs.worlds[1].open())
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        with pytest.raises(ServerError) as info:
            envs.step(envs.action_space.sample())
        assert info.value.code is ErrorCode.INTERNAL
        _, _, _, _, infos = envs.step(envs.action_space.sample())
        assert infos["chunk"].tolist() == [3, 2]  # env 0 stepped once per call; env 1 made chunk 2 now
    finally:
        envs.close()

"""web/sdk/record and web/sdk/replay: record an episode, play it back through the server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.web.conftest import run
from web.sdk.gym_env import WorldEnv
from web.sdk.record import RecordEpisode, read_episode
from web.sdk.replay import replay


def record(url: str, out, steps: int, video: str = "npz", seed: int = 5):
    env = RecordEpisode(WorldEnv(url, max_episode_steps=steps), out, video=video)
    env.action_space.seed(seed)
    frames = []
    try:
        env.reset(seed=seed)
        truncated = False
        while not truncated:
            _, _, _, truncated, _ = env.step(env.action_space.sample())
            frames.append(env.unwrapped.world.last_chunk.frames)
    finally:
        env.close()
    return frames


def test_record_then_replay_50_chunks_is_bit_identical(server, tmp_path) -> None:
    frames = record(server.url, tmp_path, 50)
    ep = read_episode(tmp_path / "episode-00000")
    assert ep.meta["model"] == "tiny" and ep.meta["seed"] == 5 and ep.meta["chunks"] == 50
    assert ep.meta["frames"] == sum(len(f) for f in frames) and ep.meta["video"] == "frames.npz"
    assert [s["chunk"] for s in ep.steps] == list(range(1, 51))
    assert ep.steps[1]["frame0"] == len(frames[0])
    for got, want in zip(ep.frames, frames, strict=True):
        np.testing.assert_array_equal(got, want)
    report = run(replay(server.url, ep))
    assert report.identical and report.chunks == 50 and report.psnr_all == float("inf"), report


def test_replay_reports_a_mismatch_with_its_psnr(server, tmp_path) -> None:
    record(server.url, tmp_path, 3)
    directory = tmp_path / "episode-00000"
    lines = (directory / "actions.jsonl").read_text().splitlines()
    step = json.loads(lines[1])
    step["actions"] = [{"keys": ["w", "a", "s", "d", "space"], "mouse": [3.0, -3.0]}]  # not what made it
    lines[1] = json.dumps(step)
    (directory / "actions.jsonl").write_text("\n".join(lines) + "\n")
    report = run(replay(server.url, directory))
    assert not report.identical and report.first_mismatch == 2
    assert 0 < report.psnr_min <= report.psnr_all < float("inf") and "PSNR" in report.summary()


def test_mp4_recording_replays_by_psnr(server, tmp_path) -> None:
    frames = record(server.url, tmp_path, 3, video="mp4")
    ep = read_episode(tmp_path / "episode-00000")
    assert (tmp_path / "episode-00000" / "episode.mp4").is_file() and not ep.lossless
    assert [len(f) for f in ep.frames] == [len(f) for f in frames]
    report = run(replay(server.url, ep))
    assert not report.lossless and report.psnr_min > 10  # random-weight noise is hard on H.264


def test_an_unfinished_episode_is_not_read(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a complete episode"):
        read_episode(tmp_path)

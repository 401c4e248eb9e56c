"""The converters' published-config constants against what the upstream files state
(tests/fixtures/golden/published_configs.json, written by make_goldens.py from the upstream trees)."""

import json

import pytest

from models.convert import matrix_game, self_forcing
from models.sampler import FlowSchedule
from tests.fixtures.golden import GOLDEN

PUBLISHED = json.loads((GOLDEN / "published_configs.json").read_text())


@pytest.mark.parametrize("variant", ["universal", "gta_drive", "templerun"])
def test_matrix_game_constants(variant: str) -> None:
    up = PUBLISHED["matrix_game_2"][variant]
    ours = matrix_game.PUBLISHED[variant]
    assert {k: v for k, v in up["config"].items() if k != "inject_sample_info"} == ours
    infer = matrix_game.INFERENCE[variant]
    u = up["inference"]
    assert infer["denoising_step_list"] == u["denoising_step_list"]
    assert infer["warp_denoising_step"] == u["warp_denoising_step"]
    assert infer["timestep_shift"] == u["model_kwargs"]["timestep_shift"]
    assert infer["num_frame_per_block"] == u["num_frame_per_block"]
    assert infer["context_noise"] == u["context_noise"]
    assert infer["latent_hw"] == u["image_or_video_shape"][3:]
    sched = FlowSchedule(tuple(u["denoising_step_list"]), u["model_kwargs"]["timestep_shift"])
    assert sched.timesteps == pytest.approx(infer["warped_timesteps"], abs=1e-3)


def test_self_forcing_constants() -> None:
    up = PUBLISHED["self_forcing"]
    ours = self_forcing.PUBLISHED
    assert all(ours[k] == v for k, v in up["model"].items()), up["model"]
    u, infer = up["inference"], self_forcing.INFERENCE
    assert infer["denoising_step_list"] == u["denoising_step_list"]
    assert infer["warp_denoising_step"] == u["warp_denoising_step"]
    assert infer["timestep_shift"] == u["model_kwargs"]["timestep_shift"]
    assert infer["num_frame_per_block"] == u["num_frame_per_block"]
    assert infer["context_noise"] == u["context_noise"] and u["independent_first_frame"] is False
    assert infer["fps"] == up["sample_fps"]
    sched = FlowSchedule(tuple(u["denoising_step_list"]), u["model_kwargs"]["timestep_shift"])
    assert sched.timesteps == pytest.approx(infer["warped_timesteps"], abs=1e-3)

"""The few-step schedule's two samplers: `renoise` draws fresh noise around the clean estimate,
`euler` (the flow ODE step) keeps the noise it has; both reach the next sigma."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from models.sampler import FlowSchedule, add_noise
from runtime import parity

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden"


def test_an_euler_step_from_an_exact_estimate_keeps_the_noise_it_had():
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 8, 4, 8, 8, generator=gen), torch.randn(2, 8, 4, 8, 8, generator=gen)
    sched = FlowSchedule(shift=3.0, sampler="euler")
    sigmas = sched.sigmas
    x = add_noise(x0, noise, sigmas[0])
    for sg, nxt in itertools.pairwise(sigmas):
        x = sched.next_x(x0, x, sg, nxt, lambda: pytest.fail("euler draws no noise"))
        torch.testing.assert_close(x, add_noise(x0, noise, nxt))


def test_a_renoise_step_uses_fresh_noise_and_ignores_the_input():
    x0, fresh = torch.zeros(1, 3), torch.ones(1, 3)
    sched = FlowSchedule(sampler="renoise")
    for x_t in (torch.full((1, 3), 5.0), torch.full((1, 3), -7.0)):
        assert torch.equal(sched.next_x(x0, x_t, 0.75, 0.5, lambda: fresh), add_noise(x0, fresh, 0.5))


def test_an_unknown_sampler_is_refused():
    with pytest.raises(ValueError, match="sampler"):
        FlowSchedule(sampler="heun")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["matrix_game_universal_rollout", "self_forcing_rollout"])
def test_warped_timesteps_are_the_originals_float32_table_exactly(name: str) -> None:
    """The originals read their shifted scheduler's float32 table: step 666 at shift 5 is
    908.8427124023438 there, 908.8427947598253 by the float64 formula."""
    golden = parity.load_golden(GOLDEN / f"{name}.safetensors")
    roll = golden.meta["rollout"]
    sched = FlowSchedule(tuple(roll["denoising_step_list"]), roll["timestep_shift"])
    assert sched.timesteps == golden.tensors["timesteps"].tolist()
    for s in range(len(sched.steps)):  # what each of the original's generator calls was given
        assert sched.timesteps[s] == golden.tensors[f"t.c0.s{s}"].item()


def test_sigmas_are_float32_values_that_give_the_timesteps():
    sched = FlowSchedule((1000, 666, 333), 5.0)
    for sg, t in zip(sched.sigmas, sched.timesteps, strict=True):
        f32 = torch.tensor(sg, dtype=torch.float32)
        assert f32.item() == sg and (f32 * 1000).item() == t


def test_an_unwarped_schedule_keeps_its_exact_steps():
    """shift 1 (the tiny world): the table holds the steps themselves, so its frames are unchanged."""
    sched = FlowSchedule((1000, 750, 500, 250), 1.0)
    assert sched.timesteps == [1000.0, 750.0, 500.0, 250.0]
    assert sched.sigmas == [1.0, 0.75, 0.5, 0.25]


def test_a_step_off_the_table_is_warped_in_float32():
    sched = FlowSchedule((1000, 666.5), 5.0)
    s = torch.tensor(0.6665, dtype=torch.float32)
    assert sched.sigmas[1] == (5.0 * s / (1 + 4.0 * s)).item()

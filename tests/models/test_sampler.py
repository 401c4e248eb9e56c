"""The few-step schedule's two samplers: `renoise` draws fresh noise around the clean estimate,
`euler` (the flow ODE step) keeps the noise it has; both reach the next sigma."""

from __future__ import annotations

import itertools

import pytest
import torch

from models.sampler import FlowSchedule, add_noise


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

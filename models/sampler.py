"""Few-step flow-matching schedule (the DMD / Self-Forcing sampler's arithmetic, no loop).

Flow matching interpolates ``x_sigma = (1 - sigma) * x0 + sigma * noise``. A step list such as
[1000, 750, 500, 250] is warped by the timestep shift, ``sigma = shift*s / (1 + (shift-1)*s)``
with ``s = step / 1000``, exactly as Self-Forcing indexes its shifted scheduler: read from the
same float32 table (`_warp_table`), so a warped step such as 666 at shift 5 is the originals'
908.8427124 and not the float64 formula's 908.8427948. Each step
predicts x0, then moves to the next sigma in one of two ways (`FlowSchedule.sampler`):

* ``renoise``: fresh noise around the clean estimate (Self-Forcing / DMD). Right for a few-step
  *generator* (a distilled model whose x0 is a sample); for a model trained by plain flow
  matching its x0 is the posterior *mean*, and re-noising the mean loses what the noise had
  already decided, so the result drifts toward the mean: blur.
* ``euler``: the deterministic flow ODE step (DDIM for flow matching), which keeps the current
  noise: ``x' = x0 + (sigma' / sigma) (x - x0)``. A regression-trained model samples sharply.

The loop lives in runtime/runner.py; this module only holds the numbers and the formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

Prediction = Literal["flow", "x0"]
Sampler = Literal["renoise", "euler"]


@dataclass(frozen=True)
class FlowSchedule:
    """Which noise levels a chunk visits."""

    steps: tuple[int, ...] = (1000, 750, 500, 250)  # raw step values, high to low, out of num_train
    shift: float = 5.0  # timestep shift (Wan: 5 at 480p, 3 at lower resolutions)
    num_train: int = 1000  # training timesteps
    prediction: Prediction = "flow"  # "flow": model predicts noise - x0 (Wan); "x0": predicts x0
    sampler: Sampler = "renoise"  # how a step reaches the next sigma (see the module docstring)

    def __post_init__(self) -> None:
        if self.sampler not in ("renoise", "euler"):
            raise ValueError(f"sampler must be 'renoise' or 'euler', not {self.sampler!r}")

    def sigma(self, step: float) -> float:
        """Shifted noise level in [0, 1] of a raw step value, in float32 arithmetic as the
        originals compute it (an integral step reads their table)."""
        return self._warped(step)[0]

    def timestep(self, step: float) -> float:
        """Model-input timestep (sigma * num_train, in float32) of a raw step value."""
        return self._warped(step)[1]

    def _warped(self, step: float) -> tuple[float, float]:
        if float(step).is_integer() and 0 <= step <= self.num_train:
            sigmas, timesteps = _warp_table(self.shift, self.num_train)
            i = self.num_train - int(step)
            return float(sigmas[i]), float(timesteps[i])
        s = torch.tensor(step / self.num_train, dtype=torch.float32)
        sigma = self.shift * s / (1 + (self.shift - 1) * s)
        return float(sigma), float(sigma * self.num_train)

    @property
    def sigmas(self) -> list[float]:
        """Noise level of each step."""
        return [self.sigma(s) for s in self.steps]

    @property
    def timesteps(self) -> list[float]:
        """Model-input timestep of each step (sigma * num_train)."""
        return [self.timestep(s) for s in self.steps]

    def to_x0(self, pred: torch.Tensor, x_t: torch.Tensor, sigma: float) -> torch.Tensor:
        """Clean estimate from a model prediction at noise level sigma."""
        if self.prediction == "flow":
            return x_t - sigma * pred
        return pred

    def next_x(
        self,
        x0: torch.Tensor,
        x_t: torch.Tensor,
        sigma: float,
        sigma_next: float,
        noise: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """The next step's input at `sigma_next` from the clean estimate `x0` of `x_t` (at `sigma`);
        `noise()` draws fresh noise, called only by the `renoise` sampler."""
        if self.sampler == "euler":
            return x0 + (sigma_next / sigma) * (x_t - x0)
        return add_noise(x0, noise(), sigma_next)


@lru_cache(maxsize=16)
def _warp_table(shift: float, num_train: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The originals' shifted scheduler as float32 tables indexed by ``num_train - step``: sigmas
    on ``linspace(1, 0, num_train + 1)[:-1]``, warped, times ``num_train`` for the timesteps,
    with a trailing 0 for step 0 (Self-Forcing's ``FlowMatchScheduler(extra_one_step=True)`` and
    its ``warp_denoising_step``; Matrix-Game 2.0 uses the same code)."""
    s = torch.linspace(1.0, 0.0, num_train + 1, dtype=torch.float32)[:-1]
    sigmas = shift * s / (1 + (shift - 1) * s)
    timesteps = sigmas * num_train
    zero = torch.zeros(1, dtype=torch.float32)
    return torch.cat([sigmas, zero]), torch.cat([timesteps, zero])


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """Flow-matching interpolation to noise level sigma."""
    return (1 - sigma) * x0 + sigma * noise

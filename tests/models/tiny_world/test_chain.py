"""The chain loss (`sf_chain`, `chain_history`): the model's own rollout with a gradient that
reaches back through the generated history."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models.registry import from_name
from models.tiny_world.training.history import chain_history, rollout_history
from tests.models.tiny_world.test_train_cli import train_tiny


def _clip(world, n_chunks: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    f = 1 + n_chunks * world.chunk_frames
    c, h, w = world.latent_shape
    x0 = torch.randn(2, c, f, h, w, generator=gen)
    actions = (torch.rand(2, f, 1, world.action_space.width, generator=gen) > 0.7).float()
    actions[:, 0] = 0.0
    return x0, actions


def test_the_chain_reproduces_the_rollout():
    world = from_name("tiny-world")
    dit, sched = world.transformer.eval(), world.config.schedule
    x0, actions = _clip(world)
    own = rollout_history(dit, x0, actions, sched, torch.Generator().manual_seed(5))
    for depth in (1, 3):
        with torch.no_grad():
            out = chain_history(dit, x0, actions, sched, torch.Generator().manual_seed(5), depth)
        torch.testing.assert_close(out, own[:, :, 1:], rtol=1e-4, atol=1e-4)


def test_each_pass_reaches_one_more_chunk_back():
    """A loss on the first chunk (whose history is the given start frame) gets the same gradient
    at any depth; a loss on the last chunk gets more with depth 2, which reaches the chunk before."""
    world = from_name("tiny-world")
    dit, sched = world.transformer.eval(), world.config.schedule
    x0, actions = _clip(world)
    chunk = world.chunk_frames

    def grad(depth: int, frames: slice) -> torch.Tensor:
        dit.zero_grad(set_to_none=True)
        out = chain_history(dit, x0, actions, sched, torch.Generator().manual_seed(5), depth)
        out[:, :, frames].pow(2).sum().backward()
        return torch.cat([p.grad.flatten() for p in dit.parameters() if p.grad is not None])

    first, last = slice(0, chunk), slice(-chunk, None)
    torch.testing.assert_close(grad(1, first), grad(2, first), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(grad(1, last), grad(2, last), rtol=1e-3, atol=1e-5)
    dit.zero_grad(set_to_none=True)


def test_the_cli_trains_with_the_chain_loss(tmp_path: Path):
    logged = train_tiny(tmp_path / "run", "--sf-steps", "2", "--sf-chain", "1", "--sf-chain-clips", "2")
    assert len(logged) == 2 and all(np.isfinite(r["chain_loss"]) and r["chain_loss"] > 0 for r in logged)

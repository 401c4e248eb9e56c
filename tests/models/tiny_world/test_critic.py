"""The sf stage's adversarial loss (`sf_adv`): a patch critic on decoded x0 predictions."""

from __future__ import annotations

from pathlib import Path

import torch

from models.tiny_world.train import main
from models.tiny_world.training.heads import FrameCritic
from tests.models.tiny_world.test_train_cli import train_tiny


def test_the_critic_scores_every_tile_and_learns_to_tell_flat_tiles_from_blur():
    torch.manual_seed(0)
    critic = FrameCritic(width=8)
    opt = torch.optim.Adam(critic.parameters(), lr=2e-3, betas=(0.5, 0.99))
    assert critic(torch.zeros(5, 3, 64, 64)).shape == (5, 64)  # one logit per 8x8 tile

    def tiles(n: int) -> torch.Tensor:  # flat random 8x8 tiles, like the game's terrain
        return torch.rand(n, 3, 8, 8).repeat_interleave(8, 2).repeat_interleave(8, 3) * 2 - 1

    def blurred(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(x, 7, 1, 3, count_include_pad=False)

    for _ in range(150):
        real = tiles(16)
        loss = torch.relu(1 - critic(real)).mean() + torch.relu(1 + critic(blurred(tiles(16)))).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        real = tiles(32)
        assert critic(real).mean() > critic(blurred(real)).mean() + 0.5


def test_adversarial_sf_trains_logs_and_resumes(tmp_path: Path):
    sf = ["--sf-steps", "2", "--sf-batch", "2", "--sf-clip-chunks", "2", "--sf-adv", "0.1", "--sf-blur", "0"]
    rows = train_tiny(tmp_path, *sf, "--sf-critic-lr", "2e-4")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("adv_g" in r and r["adv_d"] >= 0 for r in rows)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert "critic" in state and "critic_opt" in state
    assert state["critic_opt"]["param_groups"][0]["lr"] == 2e-4
    n = torch.get_num_threads()
    try:  # the checkpoint's critic loads back
        assert main(["--out", str(tmp_path), "--resume", "--export-only", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(n)

"""Refining the DiT's token grid (`regrid`, `sf_patch` / `sf_window`): a coarse model's blocks
carry over, flat regions are embedded and read out as before, and the CLI trains, exports and
resumes the refined model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from models.causal_wan import CausalWan
from models.registry import load_world
from models.tiny_world import dit_config
from models.tiny_world.train import main
from models.tiny_world.training.dit import regrid
from tests.models.tiny_world.test_train_cli import TINY


def _coarse(patch: int = 2) -> CausalWan:
    torch.manual_seed(0)
    cfg = dataclasses.replace(dit_config(), patch_size=(1, patch, patch), num_layers=2)
    return CausalWan(cfg).eval()


@pytest.mark.parametrize(("old", "new"), [(2, 1), (4, 2), (4, 1)])
def test_a_flat_patch_embeds_and_reads_out_as_before(old: int, new: int):
    coarse = _coarse(old)
    fine = regrid(coarse, new, 8)
    assert fine.cfg.patch_size == (1, new, new) and fine.cfg.window_frames == 8
    f = old // new
    # Latents flat over each coarse cell: every fine token inside a cell embeds as the cell did.
    x = torch.randn(1, 8, 1, 8 // old, 8 // old).repeat_interleave(old, 3).repeat_interleave(old, 4)
    fine_tokens, (_, fh, fw) = fine._embed(x)
    coarse_tokens, (_, ch, cw) = coarse._embed(x)
    assert (fh, fw) == (ch * f, cw * f)
    per_cell = coarse_tokens.view(ch, cw, -1).repeat_interleave(f, 0).repeat_interleave(f, 1)
    torch.testing.assert_close(fine_tokens.view(fh, fw, -1), per_cell, rtol=1e-5, atol=1e-5)
    # The head: equal hidden states give the coarse outputs averaged over each fine token's share.
    hidden = torch.randn(1, 1, coarse.cfg.dim)
    temb = torch.zeros(1, 1, coarse.cfg.dim)
    c_out = coarse._head(hidden, temb, (1, 1, 1))  # (1, C, 1, old, old)
    f_out = fine._head(hidden, temb, (1, 1, 1))  # (1, C, 1, new, new)
    expected = c_out.unflatten(3, (f, new)).unflatten(5, (f, new)).mean((3, 5))
    torch.testing.assert_close(f_out, expected, rtol=1e-5, atol=1e-5)
    # Every other weight is the coarse model's.
    cs, fs = coarse.state_dict(), fine.state_dict()
    for name, value in cs.items():
        if not name.startswith(("patch_embedding.weight", "proj_out.")):
            assert torch.equal(fs[name], value), name


def test_regrid_refuses_a_coarser_or_uneven_grid():
    with pytest.raises(ValueError):
        regrid(_coarse(2), 4, 8)
    with pytest.raises(ValueError):
        regrid(_coarse(4), 3, 8)


def test_the_cli_trains_exports_and_resumes_a_regridded_model(tmp_path: Path):
    out = tmp_path / "run"
    sf = ["--sf-steps", "2", "--sf-batch", "2", "--sf-clip-chunks", "2", "--sf-p-self", "0.5"]
    assert main(["--out", str(out), *TINY, *sf, "--sf-patch", "1", "--sf-window", "8"]) == 0
    world = load_world(out / "model")
    assert world.transformer.cfg.patch_size == (1, 1, 1) and world.transformer.cfg.window_frames == 8
    # Resuming the finished run rebuilds the refined modules before loading their weights.
    assert main(["--out", str(out), "--resume", "--export-only", "--no-progress", "--threads", "1"]) == 0
    again = load_world(out / "model")
    for name, value in world.transformer.state_dict().items():
        assert torch.equal(again.transformer.state_dict()[name], value), name

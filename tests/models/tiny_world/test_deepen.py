"""Growing the DiT deeper (`deepen`, `sf_layers`): the new blocks start as the identity, so a
grown model serves the frames the original serves; its new weights are seeded; the CLI trains,
exports and resumes a grown model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.registry import from_name, load_world
from models.tiny_world.training.dit import deepen
from tests.models.tiny_world.test_teacher_forcing import serve_random_policy, with_transformer
from tests.models.tiny_world.test_train_cli import train_tiny


def test_a_grown_model_serves_the_original_frames(tmp_path: Path):
    world = from_name("tiny-world")
    n = world.transformer.cfg.num_layers
    grown = deepen(world.transformer, n + 3, seed=0)
    assert grown.cfg.num_layers == n + 3 and grown.cfg.action.blocks == n + 3
    # The original blocks keep their weights, in order, and every block has an action module.
    old = world.transformer.state_dict()
    places = [i * (n + 3) // n for i in range(n)]
    assert places == sorted(set(places))
    for i, j in enumerate(places):
        for key, value in world.transformer.blocks[i].state_dict().items():
            assert torch.equal(grown.blocks[j].state_dict()[key], value), (i, key)
    new = [j for j in range(n + 3) if j not in places]
    for j in new:
        blk = grown.blocks[j]
        assert blk.action is not None and not blk.ffn.net[2].weight.any()
        assert blk.ffn.net[0].proj.weight.any()  # only the residual projections are zero
    for key in ("patch_embedding.weight", "proj_out.weight", "condition_embedder.time_proj.weight"):
        assert torch.equal(grown.state_dict()[key], old[key])

    served, _ = serve_random_policy(with_transformer(world, grown, tmp_path / "grown"), 1_000_321, 3)
    original, _ = serve_random_policy(world, 1_000_321, 3)
    assert np.abs(served.astype(int) - original.astype(int)).max() <= 1


def test_new_blocks_are_drawn_from_the_seed():
    base = from_name("tiny-world").transformer
    a, b, c = deepen(base, 7, seed=1), deepen(base, 7, seed=1), deepen(base, 7, seed=2)
    new = base.cfg.num_layers  # 6 -> 7 layers: the one new block is the last
    key = f"blocks.{new}.attn1.to_q.weight"
    assert torch.equal(a.state_dict()[key], b.state_dict()[key])
    assert not torch.equal(a.state_dict()[key], c.state_dict()[key])


def test_deepen_refuses_a_shallower_model():
    base = from_name("tiny-world").transformer
    with pytest.raises(ValueError, match="not more"):
        deepen(base, base.cfg.num_layers, seed=0)


def test_the_cli_trains_exports_and_resumes_a_grown_model(tmp_path: Path):
    out = tmp_path / "run"
    sf = ["--sf-steps", "2", "--sf-batch", "2", "--sf-clip-chunks", "2", "--sf-layers", "8"]
    logged = train_tiny(out, *sf)
    assert logged and all(np.isfinite(r["loss"]) for r in logged)
    world = load_world(out / "model")
    assert world.transformer.cfg.num_layers == 8
    # Resuming the finished run builds the grown modules before loading their weights.
    from models.tiny_world.train import main

    assert main(["--out", str(out), "--resume", "--export-only", "--no-progress", "--threads", "1"]) == 0
    again = load_world(out / "model").transformer.state_dict()
    for name, value in world.transformer.state_dict().items():
        assert torch.equal(again[name], value), name

"""The tiny world's key gate: its labels are the game's rule (`free_walk` against `held_moves`),
a player drawn into a wall cannot walk deeper, and the training run's `gate` stage exports a
model directory whose world carries the gate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.game import GameConfig, generate_world, held_moves
from models.registry import load_world
from models.tiny_world import ATLAS_TILES
from models.tiny_world.metrics import KEY_AXES
from models.tiny_world.training.gate import free_walk, jitter_player, world_walls
from tests.models.tiny_world.test_motion_weights import TILED
from tests.models.tiny_world.test_train_cli import train_tiny

CONFIG = GameConfig(size=64)


def free_centres(seed: int, n: int) -> np.ndarray:
    """`n` player centres (world units) in world `seed` where the player's box touches no wall."""
    world = generate_world(seed, CONFIG)
    rng = np.random.default_rng(seed)
    side, tile = CONFIG.player_size, CONFIG.tile
    out = []
    while len(out) < n:
        top_left = rng.integers(tile, CONFIG.world_units - tile - side, size=2)
        lo, hi = top_left // tile, (top_left + side - 1) // tile
        if not world.wall[lo[1] : hi[1] + 1, lo[0] : hi[0] + 1].any():
            out.append(top_left + side / 2)
    return np.array(out, dtype=np.float64)


def test_free_walk_is_the_games_rule_from_free_places():
    """From 300 free places in each of 3 worlds, for 4 frames, every key: the frames of motion
    are what `held_moves` walks (1 px a frame), blocked ones among them."""
    seeds = [3, 17, 1_000_123]
    walls = world_walls(seeds, CONFIG)
    blocked = 0
    for i, seed in enumerate(seeds):
        centres = free_centres(seed, 300)
        got = free_walk(walls, torch.full((300,), i), torch.from_numpy(centres), 4, CONFIG)
        world = generate_world(seed, CONFIG)
        for k, (_, axis, sign) in enumerate(KEY_AXES):
            player, _ = held_moves(world, centres, axis, sign, 4, CONFIG)
            assert got[:, k].tolist() == (player / CONFIG.player_speed).round().astype(int).tolist()
        blocked += int((got < 4).sum())
    assert blocked > 50  # the comparison covers walls, not only open ground


def test_a_player_drawn_into_a_wall_backs_out_but_goes_no_deeper():
    """A box pushed 2 px into the wall on its right: `d` has no room; `a` walks the 4 frames."""
    world = generate_world(3, CONFIG)
    side, tile = CONFIG.player_size, CONFIG.tile
    ys, xs = np.nonzero(world.wall[1:-1, 1:-1] & ~world.wall[1:-1, :-2])  # a wall with open ground left
    for y, x in zip(ys + 1, xs + 1, strict=True):
        left = np.array([x * tile - side + 2.0, y * tile + (tile - side) / 2])  # 2 px in
        if not world.wall[y, x - 2] and not world.wall[y, x - 1]:
            break
    centre = torch.from_numpy(left + side / 2)[None]
    got = free_walk(world_walls([3], CONFIG), torch.zeros(1, dtype=torch.long), centre, 4, CONFIG)
    assert got[0, 0] == 0 and got[0, 1] == 4  # KEY_AXES: d, a


def test_jitter_moves_only_the_sprite_centre():
    z = torch.randn(2, 15, 12, 12)
    out = jitter_player(z, 11, torch.tensor([[4.0, -8.0], [0.0, 0.0]]))
    assert torch.allclose(out[0, 11], z[0, 11] + 1.0) and torch.allclose(out[0, 12], z[0, 12] - 2.0)
    assert torch.equal(out[:, :11], z[:, :11]) and torch.equal(out[:, 13:], z[:, 13:])
    assert torch.equal(out[1], z[1])


def test_the_gate_and_terrain_stages_export_a_world_with_both(tmp_path: Path):
    train_tiny(tmp_path / "run", *TILED, "--episodes", "4", "--gate-steps", "3", "--terrain-steps", "2")
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    (record,) = [r for r in log if r["stage"] == "gate"]
    assert 0.0 <= record["accuracy"] <= 1.0 and record["pairs"] == 1 * 17 * 4  # one held-out episode
    (terrain,) = [r for r in log if r["stage"] == "terrain"]
    assert terrain["examples"] == 8192 and terrain["cross_entropy"] > 0
    world = load_world(tmp_path / "run" / "model")
    plugin = world.plugin
    assert plugin.gate is not None and plugin.keeps_last
    assert plugin.settings.carry_channels == ()  # served as the last DiT stage (sf, no carry) trained it
    assert plugin.remembers and plugin.settings.atlas_tiles == ATLAS_TILES  # its gate plans the view
    assert plugin.terrain is not None and plugin.cartographer.prior is plugin.terrain
    assert plugin.terrain.cfg.classes == len(world.decoder.ae.cfg.codebook)
    # The `ae` stage fit the codebook on its frames (these few frames show only some colours).
    (fit,) = [r for r in log if "codebook" in r]
    assert fit["stage"] == "ae" and fit["codebook"] == world.decoder.ae.cfg.codebook
    assert 2 <= len(fit["codebook"]) <= 8 and fit["flat_cells"] > 0


def test_a_run_without_a_sprite_layer_asks_for_no_gate(tmp_path: Path, capsys):
    from models.tiny_world.train import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "run"), "--ae-sprite", "false"])
    assert "--gate-steps 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written

"""Own-world targets (`sf_target` "own"): a self-rolled clip's target is the model's latest
frame moved as the game's camera moves, with the sprite repainted where the game has it and the
revealed strip out of the loss; the recorded player positions are the game's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.game import Game, GameConfig, generate_world
from models.tiny_world.data import make_episodes
from models.tiny_world.train import main
from models.tiny_world.training.targets import TileGrid, own_world_targets, snap_to_tiles, valid_latent_mask
from tests.models.tiny_world.test_train_cli import TINY

MAGENTA = torch.tensor([1.0, -1.0, 1.0])


def _frame(seed: int = 0) -> torch.Tensor:
    """(1, 3, 64, 64): distinct values everywhere (no magenta), so shifts are visible."""
    return torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(seed)) * 1.6 - 0.8


def _sprite(frame: torch.Tensor, cx: float, cy: float) -> torch.Tensor:
    """(3, H, W) copy with a 6x6 magenta square centred at (cx, cy) (integer-centred box)."""
    out = frame.clone()
    out[:, int(cy) - 3 : int(cy) + 3, int(cx) - 3 : int(cx) + 3] = MAGENTA[:, None, None]
    return out


def test_idle_target_is_the_last_frame_with_the_sprite_painted():
    last = _frame()
    centre = torch.tensor([[32.0, 32.0]])
    frames, valid = own_world_targets(
        last, torch.zeros(1, 4, 2), centre, centre[:, None].expand(1, 4, 2), 6.0
    )
    assert frames.shape == (1, 3, 4, 64, 64) and bool(valid.all())
    for j in range(4):
        expected = last[0].clone()
        expected[:, 28:36, 28:36] = last[0, :, 27:28, 28:36]  # the old sprite's box, 1 px wider, erased
        expected = _sprite(expected, 32, 32)
        assert torch.equal(frames[0, :, j], expected), j


def test_a_right_scroll_of_8_px_shifts_the_frame_and_masks_the_revealed_strip():
    last = _frame(1)
    shifts = torch.tensor([[[8.0, 0.0]]])
    centre = torch.tensor([[32.0, 32.0]])
    frames, valid = own_world_targets(last, shifts, centre, centre[:, None], 6.0)
    assert bool(valid[0, 0, :, :56].all()) and not bool(valid[0, 0, :, 56:].any())
    target = frames[0, :, 0]
    # Away from the sprite, target pixel x shows the last frame's pixel x + 8.
    assert torch.equal(target[:, :, :20], last[0, :, :, 8:28])
    assert torch.equal(target[:, 40:, :56], last[0, :, 40:, 8:])
    assert bool((target[:, :, 56:] == 0).all())  # the revealed strip is blank (and masked)
    assert torch.equal(target[:, 29:35, 29:35], MAGENTA[:, None, None].expand(3, 6, 6))
    mask = valid_latent_mask(valid, 8)[0, 0]
    assert bool((mask[:, :7] == 1).all()) and bool((mask[:, 7] == 0).all())


def test_a_one_pixel_scroll_drops_the_whole_edge_latent_column():
    frames, valid = own_world_targets(
        _frame(2),
        torch.tensor([[[0.0, -1.0]]]),
        torch.tensor([[32.0, 32.0]]),
        torch.tensor([[[32.0, 32.0]]]),
        6.0,
    )
    mask = valid_latent_mask(valid, 8)[0, 0]
    assert bool((mask[0] == 0).all()) and bool((mask[1:] == 1).all())  # scroll up: the top row is new
    assert bool((frames[0, :, 0, 0] == 0).all())


def test_a_wall_stop_keeps_the_view_and_moves_only_the_sprite():
    last = _sprite(_frame(3)[0], 32, 32)[None]
    # The camera is pinned (world edge): the player walks 4 px right on screen.
    frames, valid = own_world_targets(
        last, torch.zeros(1, 1, 2), torch.tensor([[32.0, 32.0]]), torch.tensor([[[36.0, 32.0]]]), 6.0
    )
    target = frames[0, :, 0]
    assert bool(valid.all())
    assert torch.equal(target[:, :, :27], last[0, :, :, :27])  # left of the old box: unchanged
    assert torch.equal(target[:, 29:35, 33:39], MAGENTA[:, None, None].expand(3, 6, 6))
    assert not bool((target[:, 29:35, 29:33] == MAGENTA[:, None, None]).all(dim=0).any())  # no trail


def test_recorded_player_positions_are_the_games():
    eps = make_episodes([5], 10)
    game = Game()
    game.reset(5)
    assert tuple(eps.players[0, 0]) == pytest.approx(game.player_screen_pos)
    ys, xs = (eps.frames[0, 0] == (255, 0, 255)).all(axis=-1).nonzero()
    assert (xs.mean() + 0.5, ys.mean() + 0.5) == pytest.approx(tuple(eps.players[0, 0]))


def _terrain(seed: int, camera: np.ndarray) -> np.ndarray:
    """(64, 64, 3) uint8: the game's terrain alone (no sprites) under a view corner."""
    world, centres = generate_world(seed, GameConfig()), np.arange(64) + 0.5
    tx, ty = ((camera[0] + centres) // 8).astype(int), ((camera[1] + centres) // 8).astype(int)
    return world.rgb.take(ty, axis=0).take(tx, axis=1)


def _pixels(frame: torch.Tensor) -> np.ndarray:
    return ((frame.permute(1, 2, 0) + 1) * 127.5).round().numpy().astype(np.uint8)


def test_snapping_redraws_the_games_terrain_without_its_sprites_even_from_a_blurred_frame():
    eps, grid = make_episodes([5, 7], 30), TileGrid.of(GameConfig())
    gen = torch.Generator().manual_seed(0)
    for e in range(2):
        for f in (0, 17, 30):
            frame = torch.from_numpy(eps.frames[e, f]).float().permute(2, 0, 1)[None] / 127.5 - 1
            assert (frame[0] == MAGENTA[:, None, None]).all(dim=0).any()  # the sprite is there
            camera = torch.from_numpy(eps.cameras[e, f])[None]
            terrain = _terrain(int(eps.seeds[e]), eps.cameras[e, f])
            assert np.array_equal(_pixels(snap_to_tiles(frame, camera, grid)[0]), terrain)
            # A 3x3 box blur plus noise (the model's softening): all but thin edge tiles survive.
            soft = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(frame, (1,) * 4, "replicate"), 3, 1)
            soft = soft + 0.05 * torch.randn(soft.shape, generator=gen)
            wrong = (_pixels(snap_to_tiles(soft, camera, grid)[0]) != terrain).any(-1)
            assert wrong.mean() < 0.02


def test_snapped_targets_follow_the_grid_phase_of_the_camera():
    eps, grid = make_episodes([5], 8), TileGrid.of(GameConfig())
    assert eps.cameras[0, 0, 0] % 8 != 0 and eps.cameras[0, 4, 0] != eps.cameras[0, 0, 0]  # off-grid, moving
    last = torch.from_numpy(eps.frames[0, 0]).float().permute(2, 0, 1)[None] / 127.5 - 1
    shifts = torch.from_numpy(eps.cameras[0, 1:5] - eps.cameras[0, 0])[None]
    frames, valid = own_world_targets(
        last,
        shifts,
        torch.from_numpy(eps.players[0, 0])[None],
        torch.from_numpy(eps.players[0, 1:5])[None],
        6.0,
        grid=grid,
        camera=torch.from_numpy(eps.cameras[0, 0])[None],
    )
    # Where they are valid, the targets are the game's frames (terrain moved, sprite repainted).
    for j in range(4):
        got = _pixels(frames[0, :, j])
        keep = valid[0, j].numpy() & ~(eps.frames[0, 1 + j] == (222, 40, 36)).all(-1)  # no creatures
        assert keep.mean() > 0.9 and np.array_equal(got[keep], eps.frames[0, 1 + j][keep]), j


def test_own_targets_train_from_the_cli(tmp_path: Path):
    n = torch.get_num_threads()
    try:
        sf = ["--sf-steps", "2", "--sf-batch", "2", "--sf-clip-chunks", "2"]
        sf += ["--sf-p-self", "1", "--sf-target", "own", "--sf-snap", "true"]
        assert main(["--out", str(tmp_path), *TINY, *sf]) == 0
    finally:
        torch.set_num_threads(n)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    rows = [r for r in log if r["stage"] == "sf" and "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 < r["supervised"] <= 1.0 for r in rows)  # the weighted loss ran
    config = torch.load(tmp_path / "ckpt.pt", weights_only=False)["config"]
    assert config["sf_target"] == "own" and config["sf_snap"] is True

"""Anchored targets (`sf_target` "anchor"): a self-rolled clip's targets are the game's own
frames from the place the model's world shows, found by matching its latest frame against the
game's terrain, so they agree with the model's history and still follow the game's rules."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from models.game import Game, GameConfig, random_policy
from models.tiny_world.training.config import TrainConfig
from models.tiny_world.training.history import gaussian_blur
from models.tiny_world.training.targets import ANCHOR_MARGIN, match_shift
from models.tiny_world.training.trainer import Trainer
from tests.models.tiny_world.test_train_cli import train_tiny


def _unit(frames: np.ndarray) -> torch.Tensor:
    """(..., H, W, 3) uint8 -> (..., 3, H, W) float in [-1, 1]."""
    return torch.from_numpy(np.ascontiguousarray(frames)).movedim(-1, -3).float() / 127.5 - 1.0


@pytest.mark.parametrize("dx,dy", [(0, 0), (7, -3), (-12, 20)])
def test_match_shift_finds_the_view_a_soft_frame_shows(dx: int, dy: int) -> None:
    game = Game(GameConfig(creatures=0))
    game.reset(11)
    terrain = _unit(game.terrain(ANCHOR_MARGIN))
    m = ANCHOR_MARGIN
    view = terrain[:, m + dy : m + dy + 64, m + dx : m + dx + 64]
    soft = gaussian_blur(view[None], torch.tensor([1.5]))[0]
    sx, sy, quality = match_shift(soft, terrain, m)
    assert (sx, sy) == (dx, dy)
    assert quality > 20.0
    noise = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert match_shift(noise, terrain, m)[2] < 10.0  # nothing like the map: a poor match


def _identity_ae() -> types.SimpleNamespace:
    """Frames as their own latents, so the test sees the targets' pixels."""
    return types.SimpleNamespace(eval=lambda: None, decode_float=lambda z: z, encode_float=lambda x: x)


def _played(seed: int, actions: list, shift: tuple[int, int] | None, start: int) -> np.ndarray:
    """Frames start .. start + len(actions) of the episode's game; with `shift`, the player is
    moved by it at frame `start` (a model whose world is off by a constant shift)."""
    game = Game(GameConfig())
    game.reset(seed)
    policy = random_policy(seed, 40)
    while game.frame_index < start:
        game.step(policy[game.frame_index])
    if shift is not None:
        x, y = np.array(game.player_world_pos) - 3.0
        game.place_player(x + shift[0], y + shift[1])
    return np.stack([game.render()] + [game.step(k) for k in actions])


def test_a_world_off_by_a_shift_gets_its_own_frames_as_targets(tmp_path: Path) -> None:
    cfg = TrainConfig(
        episodes=4, episode_frames=40, world_seed_base=0, ae_creatures=False, sf_creature_start=False
    )
    trainer = Trainer(cfg, tmp_path, None, progress=False)
    trainer.ae = _identity_ae()
    start, f = 8, 17
    found = 0
    for e in range(4):
        policy = random_policy(e, 40)
        actions = policy[start : start + f - 1]
        truth = _played(e, actions, None, start)
        try:
            own = _played(e, actions, (5, -4), start)
        except Exception:
            continue  # the shifted player would stand in a wall
        hist = _unit(own).movedim(0, 1)[None]  # (1, 3, F, 64, 64)
        x0 = _unit(truth).movedim(0, 1)[None]
        tgt, weight, shift = trainer.anchored_targets(hist, x0, np.array([e]), np.array([start]))
        ok = shift[0, :, 0].isfinite()
        if not ok.all():
            continue  # a clamped camera: the chunk is left out, as it must be
        found += 1
        assert shift[0, 0].tolist() == [5.0, -4.0]  # later chunks may differ where a wall stopped one world
        assert bool((weight == 1).all())
        torch.testing.assert_close(tgt[:, :, 1:], hist[:, :, 1:])  # the shifted world's own next frames
        assert not torch.equal(tgt[:, :, 1:], x0[:, :, 1:])
    assert found >= 1


def test_a_frame_unlike_the_map_is_left_out(tmp_path: Path) -> None:
    trainer = Trainer(
        TrainConfig(episodes=1, episode_frames=40, ae_creatures=False, sf_creature_start=False),
        tmp_path,
        None,
        progress=False,
    )
    trainer.ae = _identity_ae()
    truth = _unit(_played(0, random_policy(0, 40)[:16], None, 0)).movedim(0, 1)[None]
    hist = truth.clone()
    hist[:, :, 4] = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    tgt, weight, shift = trainer.anchored_targets(hist, truth, np.array([0]), np.array([0]))
    assert shift[0, 1].isnan().all() and shift[0, [0, 2, 3]].isfinite().all()
    assert bool((weight[:, :, 4:8] == 0).all()) and bool((weight[:, :, :4] == 1).all())
    torch.testing.assert_close(tgt[:, :, 5:9], truth[:, :, 5:9])  # left out: the ground truth kept
    torch.testing.assert_close(tgt[:, :, 1:5], truth[:, :, 1:5])  # anchored at shift 0: the game


def test_the_cli_trains_on_anchored_targets_after_a_lead(tmp_path: Path) -> None:
    sf = ["--sf-batch", "2", "--sf-p-self", "1", "--sf-target", "anchor", "--sf-lead", "1", "--sf-blur", "0"]
    rows = train_tiny(tmp_path, *sf)
    assert [r["step"] for r in rows] == [1, 2]
    # An untrained model's frames match the map poorly or not at all; either way it is recorded.
    assert all(0.0 <= r["anchored"] <= 1.0 and r["supervised"] == r["anchored"] for r in rows)
    assert (tmp_path / "model" / "worldserve.json").is_file()

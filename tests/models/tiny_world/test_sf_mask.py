"""The self-forced stage's loss mask: a latent pixel is supervised iff its whole 8x8 footprint
showed ground the clip's start frame showed (the camera track decides), and the recorded
cameras are the game's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.game import Game
from models.tiny_world.data import make_episodes
from models.tiny_world.train import parse_bool
from models.tiny_world.training.targets import seen_latent_mask


def _track(*offsets: tuple[float, float], start: tuple[float, float] = (40.0, 100.0)) -> torch.Tensor:
    """(1, F, 2) cameras: the start camera plus each offset."""
    cams = torch.tensor([start, *[(start[0] + dx, start[1] + dy) for dx, dy in offsets]])
    return cams[None].float()


def test_idle_clip_is_seen_everywhere():
    mask = seen_latent_mask(_track(*[(0.0, 0.0)] * 8), 64, 8)
    assert mask.shape == (1, 9, 8, 8) and bool((mask == 1).all())


def test_a_scroll_right_hides_the_revealed_columns_only():
    mask = seen_latent_mask(_track((1.0, 0.0), (8.0, 0.0), (9.0, 0.0), (16.0, 0.0)), 64, 8)[0]
    assert bool((mask[0] == 1).all())
    # 1 px: the last latent column has one unseen pixel column, so all of it is out.
    for frame, hidden in ((1, 1), (2, 1), (3, 2), (4, 2)):
        assert bool((mask[frame, :, 8 - hidden :] == 0).all()), frame
        assert bool((mask[frame, :, : 8 - hidden] == 1).all()), frame


def test_scrolls_up_and_left_hide_the_top_and_left_edges():
    mask = seen_latent_mask(_track((-8.0, -16.0)), 64, 8)[0, 1]
    expected = torch.zeros(8, 8)
    expected[2:, 1:] = 1.0
    assert torch.equal(mask, expected)


def test_a_clamped_camera_at_the_world_edge_hides_nothing():
    # The player walks but the view is pinned to the world's corner: the camera never moves.
    mask = seen_latent_mask(_track(*[(0.0, 0.0)] * 4, start=(0.0, 0.0)), 64, 8)
    assert bool((mask == 1).all())


def test_recorded_cameras_are_the_games():
    eps = make_episodes([3], 20)
    game = Game()
    game.reset(3)
    assert tuple(eps.cameras[0, 0]) == pytest.approx(game.camera)
    steps = np.abs(np.diff(eps.cameras[0], axis=0))
    assert steps.max() <= 1.0  # the view scrolls at most 1 px per frame per axis


def test_seen_pixels_repeat_the_start_frame_but_for_sprites():
    eps = make_episodes([7], 64)
    frames = eps.frames[0].astype(int)
    cams = torch.from_numpy(eps.cameras[:, :17])
    mask = seen_latent_mask(cams, 64, 8)[0]
    assert mask[1:].mean() < 1.0  # this clip scrolls
    same = total = 0
    for j in range(1, 17):
        dx, dy = (int(v) for v in (cams[0, j] - cams[0, 0]).tolist())
        ys, xs = np.nonzero(mask[j].repeat_interleave(8, 0).repeat_interleave(8, 1).numpy())
        same += int((frames[j][ys, xs] == frames[0][ys + dy, xs + dx]).all(-1).sum())
        total += ys.size
    assert same / total > 0.9  # only the player and the creatures move against the ground


def test_parse_bool():
    assert parse_bool("true") and parse_bool("1") and not parse_bool("False")
    with pytest.raises(Exception, match="true or false"):
        parse_bool("maybe")

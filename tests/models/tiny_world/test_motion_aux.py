"""The motion head (`--sf-motion-aux`): every clean frame's tokens predict how far the player
and the view move under each key from there (`key_motions`, the game's rule on the world's map),
so the DiT's tokens must hold the walls and the world's edge that the motion depends on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.tiny_world.training.clips import MOTION_FRAMES, key_motions
from tests.models.tiny_world.test_motion_weights import TILED, wall_walk
from tests.models.tiny_world.test_train_cli import train_tiny


def test_key_motions_see_the_wall_ahead_and_the_way_back():
    """World 1_005_004's `d` walk from the spawn is stopped by a wall after 9 frames: from frame t
    holding `d` walks min(8, 9 - t) px of 8, then none; `a` walks back freely all the way, and
    so do `s` and `w`; the view follows the player along x, but the walk runs along the world's
    bottom edge (the camera clamped there, the player 4 px below the view's centre), so under
    `s` the view stays and under `w` it moves once the player has walked the 4 px to the centre."""
    seed = 1_005_004
    _, cams, players = wall_walk(seed, [frozenset("d")] * 12)
    got = key_motions(np.array([seed]), cams, players)
    assert got.shape == (1, 13, 8)
    want_d = [min(MOTION_FRAMES, max(9 - t, 0)) / MOTION_FRAMES for t in range(13)]
    assert got[0, :, 0].tolist() == pytest.approx(want_d)  # KEY_AXES: d, a, s, w
    assert (got[0, :, 1:4] == 1.0).all()
    assert torch.equal(got[0, :, 4:6], got[0, :, :2])
    assert (got[0, :, 6] == 0.0).all() and (got[0, :, 7] == 0.5).all()
    # Another world's map under the same walk gives other motions: the seed picks the map.
    assert not torch.equal(key_motions(np.array([seed + 1]), cams, players), got)


def test_the_motion_head_trains_and_checkpoints_and_leaves_the_flow_loss_alone(tmp_path: Path):
    """The first step's flow loss is a plain run's (the head only reads the tokens); the log
    keeps the head's loss, the checkpoint the head; the step after differs (the DiT learned)."""
    plain = train_tiny(tmp_path / "plain", *TILED)
    aux = train_tiny(tmp_path / "aux", *TILED, "--sf-motion-aux", "5", "--ckpt-every", "1")
    assert aux[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert all(r["motion_aux"] > 0 for r in aux) and "motion_aux" not in plain[0]
    assert aux[1]["loss"] != pytest.approx(plain[1]["loss"], rel=1e-6)
    state = torch.load(tmp_path / "aux" / "ckpt.pt", weights_only=False)
    assert state["aux_heads"]["motion.weight"].shape == (8, 128) and "marker.weight" not in state["aux_heads"]


def test_the_aux_weights_are_not_negative(tmp_path: Path):
    with pytest.raises(SystemExit, match="weights >= 0"):
        train_tiny(tmp_path / "run", *TILED, "--sf-motion-aux", "-1")

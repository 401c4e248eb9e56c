"""Frame measures of the eval: sprite counting and sharpness."""

from __future__ import annotations

import numpy as np

from models.game import simulate
from models.tiny_world.metrics import sharpness, sprite_count


def test_sprite_count_sees_one_player_in_the_game_and_counts_doubles():
    frame = simulate(1_000_000, [frozenset()] * 2).frames[-1]
    assert sprite_count(frame) == 1
    double = frame.copy()
    double[2:6, 2:6] = (255, 0, 255)  # a second player-coloured blob, away from the first
    assert sprite_count(double) == 2
    speck = frame.copy()
    speck[2, 2] = (255, 0, 255)  # a stray pixel is not a sprite
    assert sprite_count(speck) == 1
    gone = np.where((frame == (255, 0, 255)).all(-1, keepdims=True), 0, frame).astype(np.uint8)
    assert sprite_count(gone) == 0


def test_sharpness_drops_when_frames_blur():
    frames = simulate(1_000_001, [frozenset({"d"})] * 3).frames
    f = frames.astype(np.float32)
    # a wide box blur (a narrow one keeps the total variation of isolated edges) and a flat frame
    blurred = sum(np.roll(np.roll(f, i, axis=2), j, axis=1) for i in range(-4, 5) for j in range(-4, 5)) / 81
    s, b = sharpness(frames), sharpness(blurred.astype(np.uint8))
    assert s.shape == (4,) and np.all(s > 0)
    assert np.all(b < 0.75 * s)
    assert np.all(sharpness(np.full_like(frames, 90)) == 0)

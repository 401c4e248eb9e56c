"""Frame measures of the eval: sprite counting, sharpness, free worlds, unseen worlds redrawn."""

from __future__ import annotations

import numpy as np

from models.game import Game, GameConfig, generate_world, simulate
from models.tiny_world.metrics import sharpness, sprite_count, unseen_resampled


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


def test_free_worlds_scroll_the_view_a_pixel_a_frame_under_every_key():
    from models.game import simulate
    from models.tiny_world.metrics import KEY_AXES, free_worlds

    seeds = free_worlds(3, 12, 1_000_000)
    assert len(seeds) == 3 and seeds == sorted(seeds) and seeds[0] >= 1_000_000
    for key, axis, sign in KEY_AXES:
        for seed in seeds:
            sim = simulate(seed, [frozenset({key})] * 12)
            assert (sim.player_world_pos[-1, axis] - sim.player_world_pos[0, axis]) * sign == 12
            assert (sim.player_pos == sim.player_pos[0]).all()  # the camera follows
    skipped = sorted(set(range(seeds[0], seeds[-1])) - set(seeds))
    for seed in skipped:  # every seed passed over is blocked or clamped under some key
        assert seed not in free_worlds(1, 12, seed)[:1]
    only_d = free_worlds(3, 12, 1_000_000, keys="d")
    assert len(only_d) == 3 and only_d[-1] <= seeds[-1]  # one key is a weaker condition than four


def test_unseen_resampled_keeps_the_first_frame_and_redraws_the_rest():
    seed, config = 1_000_000, GameConfig()
    truth = generate_world(seed, config)
    worlds = [unseen_resampled(seed, 7_000_000 + k) for k in range(3)]
    start = Game(config).reset(seed)
    for w in worlds:
        assert np.array_equal(Game(config).reset(seed, w), start)  # what the model is shown
        assert w.wall[[0, -1], :].all() and w.wall[:, [0, -1]].all()  # still a game world
        assert not np.array_equal(w.kind, truth.kind)
    # the first view shows no border here, so the place of the view in the world is drawn too
    assert len({tuple(w.spawn) for w in worlds}) > 1
    again = unseen_resampled(seed, 7_000_000)
    assert np.array_equal(again.rgb, worlds[0].rgb) and np.array_equal(again.spawn, worlds[0].spawn)


def test_unseen_resampled_keeps_a_border_the_first_frame_shows():
    seed = 13  # its first view stops at the world's right edge, and shows no top or bottom edge
    spawns = np.stack([unseen_resampled(seed, 7_000_000 + k).spawn for k in range(6)])
    assert np.all(spawns[:, 0] == generate_world(seed, GameConfig()).spawn[0])
    assert len(set(spawns[:, 1])) > 1
    # so holding d walks the player up to the same wall on every redrawn world
    moves = [frozenset({"d"})] * 40
    truth = simulate(seed, moves).player_pos[-1]
    assert all(
        np.array_equal(
            simulate(seed, moves, world=unseen_resampled(seed, 7_000_000 + k)).player_pos[-1], truth
        )
        for k in range(6)
    )

"""Tests for models/game/simulator.py: determinism, walls, camera, colours, positions."""

import numpy as np
import pytest

from models.game import (
    Game,
    GameConfig,
    GameError,
    Palette,
    generate_world,
    held_moves,
    random_policy,
    simulate,
)

PALETTE = Palette()


def colour_mask(frames: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """(..., H, W) bool: pixels of exactly ``colour``."""
    return (frames == np.array(colour, dtype=np.uint8)).all(axis=-1)


def touches_wall(game: Game, key: str) -> bool:
    """Whether the player's box is flush against a wall tile on the side ``key`` moves towards."""
    cfg = game.config
    half = cfg.player_size / 2.0
    wx, wy = game.player_world_pos
    x0, y0, x1, y1 = wx - half, wy - half, wx + half, wy + half
    t = cfg.tile
    cols = range(int(x0 // t), int(np.ceil(x1 / t)))
    rows = range(int(y0 // t), int(np.ceil(y1 / t)))
    wall = game.world.wall
    edge = {"d": x1, "a": x0, "s": y1, "w": y0}[key]
    if edge % t:
        return False
    line = int(edge // t) - (key in "aw")  # the tile column/row just beyond that edge
    if key in "ad":
        return bool(wall[list(rows), line].any())
    return bool(wall[line, list(cols)].any())


def test_same_seed_and_actions_give_identical_frames() -> None:
    actions = random_policy(7, 120)
    a = simulate(11, actions)
    b = simulate(11, actions)
    np.testing.assert_array_equal(a.frames, b.frames)
    np.testing.assert_array_equal(a.player_pos, b.player_pos)
    assert a.frames.shape == (121, 64, 64, 3) and a.frames.dtype == np.uint8
    assert a.player_pos.shape == a.player_world_pos.shape == (121, 2)

    game = Game()
    game.reset(5)
    for keys in actions[:30]:
        game.step(keys)
    np.testing.assert_array_equal(game.reset(11), a.frames[0])  # reset forgets the previous run
    for i, keys in enumerate(actions, start=1):
        np.testing.assert_array_equal(game.step(keys), a.frames[i])


def test_different_seeds_give_different_worlds() -> None:
    config = GameConfig()
    worlds = [generate_world(seed, config) for seed in range(4)]
    for w in worlds[1:]:
        assert not np.array_equal(w.rgb, worlds[0].rgb)
        assert not np.array_equal(w.spawn, worlds[0].spawn)
    first = [simulate(seed, []).frames[0] for seed in range(4)]
    assert all(not np.array_equal(f, first[0]) for f in first[1:])


def test_world_has_every_terrain_kind_a_closed_border_and_a_free_spawn() -> None:
    config = GameConfig()
    for seed in range(5):
        world = generate_world(seed, config)
        assert set(np.unique(world.kind)) == {0, 1, 2, 3}
        assert world.wall[[0, -1], :].all() and world.wall[:, [0, -1]].all()
        sx, sy = (world.spawn // config.tile).astype(int)
        assert not world.wall[sy - 1 : sy + 2, sx - 1 : sx + 2].any()


@pytest.mark.parametrize("key", ["w", "a", "s", "d"])
def test_walls_block_the_player(key: str) -> None:
    # Within one world width in a straight line the player always meets a wall (the border at
    # the latest); from then on its position must not change, flush against that wall.
    config = GameConfig()
    for seed in range(4):
        result = simulate(seed, [key] * config.world_units, config)
        pos = result.player_world_pos
        moved = np.abs(np.diff(pos, axis=0)).sum(axis=1) > 0
        stop = int(np.argmin(moved))
        assert stop > 0 and not moved[stop:].any(), "the player should walk, then stay stopped"
        game = Game(config)
        game.reset(seed)
        for _ in range(stop):
            game.step(key)
        assert game.player_world_pos == tuple(pos[-1])
        assert touches_wall(game, key)


def test_walls_block_a_diagonal_on_one_axis_only() -> None:
    config = GameConfig(wall_segments=0)
    result = simulate(2, [{"w", "a"}] * 2 * config.world_units, config)
    low = config.tile + config.player_size / 2.0  # centre when flush with the top-left border
    np.testing.assert_array_equal(result.player_world_pos[-1], (low, low))


def test_holding_d_scrolls_the_view_by_one_pixel_per_frame() -> None:
    config = GameConfig(creatures=0)
    scrolled = 0
    for seed in range(10):
        game = Game(config)
        before = game.reset(seed)
        cam_before = game.camera
        after = game.step("d")
        assert not np.array_equal(before, after)
        if game.camera[0] != cam_before[0] + 1:
            continue  # blocked, or camera clamped at the world edge
        scrolled += 1
        keep = ~(colour_mask(before, PALETTE.player)[:, 1:] | colour_mask(after, PALETTE.player)[:, :-1])
        np.testing.assert_array_equal(after[:, :-1][keep], before[:, 1:][keep])
    assert scrolled >= 5


def test_right_then_left_returns_to_the_same_frame() -> None:
    returned = 0
    for seed in range(12):
        plain = simulate(seed, ["d"] * 16 + ["a"] * 16, GameConfig(creatures=0))
        if not np.array_equal(plain.player_world_pos[0], plain.player_world_pos[-1]):
            continue  # a wall cut the walk short
        returned += 1
        assert not np.array_equal(plain.frames[16], plain.frames[0])
        np.testing.assert_array_equal(plain.frames[-1], plain.frames[0])

        # With creatures the place is the same once the creatures' pixels are masked out.
        live = simulate(seed, ["d"] * 16 + ["a"] * 16)
        first, last = live.frames[0], live.frames[-1]
        still = ~(colour_mask(first, PALETTE.creature) | colour_mask(last, PALETTE.creature))
        np.testing.assert_array_equal(first[still], last[still])
    assert returned >= 6


def test_player_is_centred_unless_the_camera_is_clamped() -> None:
    config = GameConfig(wall_segments=0)
    game = Game(config)
    game.reset(3)
    top = config.world_units - config.view
    centre = config.size / 2.0
    for keys in random_policy(3, 200) + ["a"] * 400:
        game.step(keys)
        for axis in (0, 1):
            if 0 < game.camera[axis] < top:
                assert game.player_screen_pos[axis] == centre
    # Flush against the left border the camera is clamped and the player is off-centre.
    assert game.camera[0] == 0
    assert game.player_screen_pos[0] == config.tile + config.player_size / 2.0


@pytest.mark.parametrize("size", [64, 96, 128])
def test_player_colour_is_unique_and_its_centroid_is_the_screen_position(size: int) -> None:
    config = GameConfig(size=size)
    side = config.player_size * config.scale
    for seed in range(6):
        world = generate_world(seed, config)
        assert not colour_mask(world.rgb, PALETTE.player).any()
        result = simulate(seed, random_policy(seed + 100, 60), config)
        for frame, pos in zip(result.frames, result.player_pos, strict=True):
            mask = colour_mask(frame, PALETTE.player)
            rows, cols = np.nonzero(mask.any(axis=1))[0], np.nonzero(mask.any(axis=0))[0]
            # Exactly one solid player-sized square and nothing else in that colour.
            assert rows.size == cols.size == side
            assert mask.sum() == rows.size * cols.size == mask[rows[0] :, cols[0] :][:, : cols.size].sum()
            centroid = (cols.mean() + 0.5, rows.mean() + 0.5)
            np.testing.assert_allclose(centroid, pos, atol=0.5 if size == 96 else 1e-9)


def test_space_shows_a_ring_for_action_frames() -> None:
    config = GameConfig()
    result = simulate(4, [{"space"}] + [set()] * config.action_frames, config)
    ring = colour_mask(result.frames, PALETTE.action).sum(axis=(1, 2))
    assert ring[0] == 0
    assert (ring[1 : 1 + config.action_frames] > 0).all()
    assert ring[-1] == 0
    # The ring surrounds the player: its centroid is the player's.
    rows, cols = np.nonzero(colour_mask(result.frames[1], PALETTE.action))
    np.testing.assert_allclose((cols.mean() + 0.5, rows.mean() + 0.5), result.player_pos[1])


def test_creatures_wander_and_never_enter_walls() -> None:
    config = GameConfig()
    game = Game(config)
    game.reset(9)
    start = game.creature_world_pos
    half = config.creature_size / 2.0
    for _ in range(300):
        game.step([])
        corners = np.concatenate(
            [
                game.creature_world_pos + np.array([dx, dy])
                for dx in (-half, half - 1e-6)
                for dy in (-half, half - 1e-6)
            ]
        )
        tiles = (corners // config.tile).astype(int)
        assert not game.world.wall[tiles[:, 1], tiles[:, 0]].any()
    assert (np.abs(game.creature_world_pos - start).sum(axis=1) > 0).all()


def test_misuse_raises() -> None:
    game = Game()
    with pytest.raises(GameError):
        game.step(["d"])
    with pytest.raises(GameError):
        game.render()
    game.reset(0)
    with pytest.raises(ValueError, match="unknown key"):
        game.step(["x"])
    with pytest.raises(GameError):
        GameConfig(player_size=9)
    with pytest.raises(GameError):
        GameConfig(palette=Palette(creature=(255, 0, 255)))


def test_terrain_is_the_frame_without_sprites_and_extends_past_the_view() -> None:
    game = Game(GameConfig(creatures=0))
    frame = game.reset(4)
    terrain = game.terrain(margin=5)
    assert terrain.shape == (64 + 10, 64 + 10, 3)
    sprite = colour_mask(frame, PALETTE.player)
    np.testing.assert_array_equal(terrain[5:-5, 5:-5][~sprite], frame[~sprite])
    assert not colour_mask(terrain, PALETTE.player).any()
    # The margin is what the view shows after scrolling: hold d for 3 frames (no wall in the way).
    for seed in range(10):
        game.reset(seed)
        x0 = game.camera[0]
        wide = game.terrain(margin=3)
        for _ in range(3):
            game.step("d")
        if game.camera[0] != x0 + 3:
            continue
        np.testing.assert_array_equal(game.terrain()[:, :], wide[3:-3, 6:])
        return
    pytest.fail("no seed could scroll 3 pixels")


def test_place_player_teleports_and_refuses_walls_and_the_outside() -> None:
    game = Game(GameConfig(creatures=0))
    game.reset(2)
    x, y = game.world.spawn
    game.place_player(x + 5, y + 3)
    assert game.player_world_pos == (x + 5 + 3, y + 3 + 3)
    with pytest.raises(GameError, match="wall"):
        game.place_player(1.0, 1.0)  # inside the border wall
    with pytest.raises(GameError, match="outside"):
        game.place_player(-4.0, y)
    assert game.player_world_pos == (x + 5 + 3, y + 3 + 3)  # a refused move leaves it in place


def test_layers_record_the_frames_without_the_player_and_the_ring_flag() -> None:
    keys = [{"d"}] * 3 + [{"space", "s"}] + [set()] * 8
    plain = simulate(7, keys)
    result = simulate(7, keys, layers=True)
    assert plain.backdrops is None and plain.rings is None
    np.testing.assert_array_equal(result.frames, plain.frames)  # recording layers changes nothing
    assert result.backdrops.shape == result.frames.shape
    sprite = colour_mask(result.frames, PALETTE.player) | colour_mask(result.frames, PALETTE.action)
    # The backdrops differ from the frames exactly where the player or its ring is drawn...
    np.testing.assert_array_equal((result.backdrops != result.frames).any(axis=-1), sprite)
    assert not colour_mask(result.backdrops, PALETTE.player).any()
    # ...and are what the game renders without the player.
    game = Game()
    game.reset(7)
    np.testing.assert_array_equal(result.backdrops[0], game.render(player=False))
    rings = colour_mask(result.frames, PALETTE.action).any(axis=(1, 2))
    np.testing.assert_array_equal(result.rings, rings)
    assert rings.sum() == GameConfig().action_frames


def test_held_moves_are_what_the_game_does_when_a_key_is_held() -> None:
    """From every 5th frame of random play, holding each key for 8 frames moves the player and
    the view exactly as far as `held_moves` says; walls and the world's edge both occur."""
    config = GameConfig()
    moves, views = [], []
    for seed in (4, 11):
        keys = random_policy(seed, 120)
        sim = simulate(seed, keys)
        world = generate_world(seed, config)
        starts = np.arange(0, 121, 5)
        for key, axis, sign in (("d", 0, 1), ("a", 0, -1), ("s", 1, 1), ("w", 1, -1)):
            player, view = held_moves(world, sim.player_world_pos[starts], axis, sign, 8, config)
            for i, t in enumerate(starts):
                game = Game(config)
                game.reset(seed)
                for k in keys[:t]:
                    game.step(k)
                p0, c0 = game.player_world_pos[axis], game.camera[axis]
                for _ in range(8):
                    game.step({key})
                assert player[i] == pytest.approx((game.player_world_pos[axis] - p0) * sign)
                assert view[i] == pytest.approx((game.camera[axis] - c0) * sign)
            moves.append(player)
            views.append(view)
    moves, views = np.concatenate(moves), np.concatenate(views)
    assert (moves < 8).any() and (moves == 8).any()  # some walks hit a wall
    assert (views < moves).any()  # and some views stop at the world's edge

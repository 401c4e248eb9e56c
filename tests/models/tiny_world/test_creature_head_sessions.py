"""A world's creature head in the chunk loop (the shipped tiny world's autoencoder, DiT and heads,
with a creature head whose walk is fixed): committed chunks hold the creatures where the head
walked them, sessions keep the trail it reads, a snapshot of the state round-trips, and a creature
the view leaves behind is there when it comes back (the atlas's creature memory)."""

from __future__ import annotations

import pytest
import torch

from models.registry import load_world
from models.tiny_world import WEIGHTS_DIR
from models.tiny_world.creature_head import CreatureHead
from models.tiny_world.fast_decoder import read_creatures
from models.tiny_world.training.creatures import creature_config
from models.world import Conditioning, World
from runtime.engine import Engine
from tests.models.tiny_world.test_creature_head import corners_of
from tests.runtime.conftest import committed, keys

SEED = 5  # its start frame shows one creature wholly, at (29, 13)


def walking_world(dx: int) -> World:
    """The shipped world with a creature head that moves every creature `dx` px along x per
    chunk (reached in the chunk's second frame) and meets none."""
    world = load_world(WEIGHTS_DIR)
    head = CreatureHead(creature_config(world.decoder.ae))
    m = head.cfg.max_step
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.births[:, 0] = -30.0
        head.entries.fill_(-30.0)
        bias = torch.zeros(head.cfg.horizon, 2, head.cfg.moves)
        for f in range(head.cfg.horizon):
            bias[f, 0, m + (dx if f else dx // 2)] = 20.0
            bias[f, 1, m] = 20.0
        head.out.bias.copy_(bias.flatten())
    world.plugin.creatures = head
    world.plugin.bind(world)
    return world


def creatures(world: World, z: torch.Tensor) -> list[tuple[int, int]]:
    """Canvas pixels where the creatures of a latent frame z (C, h, w), or of its creature
    channels alone (3, h, w), start."""
    ae = world.decoder.ae
    cs = ae.cfg.creature_slice
    own = z[cs] if z.shape[0] == ae.cfg.latent_channels else z
    raw = own[None] * ae.latents_std[cs, 0] + ae.latents_mean[cs, 0]
    present, offsets = read_creatures(raw, ae.cfg.spatial)
    return corners_of(present[0], offsets[0], ae.cfg.spatial)


@pytest.fixture(scope="module")
def world() -> World:
    return walking_world(2)


def test_committed_chunks_hold_the_creatures_where_the_head_walked_them(world):
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=SEED))
    state = engine.runner.streams["s"].state.plugin_state
    (x0, y0), *_ = start = creatures(world, state.last[:, 0])
    assert len(start) == 1
    assert state.trail is not None and state.trail.shape[1] == 2  # the start frame stands in
    for chunk in range(1, 3):
        committed(engine, "s", keys())  # idle: the view stays, the creature walks on
        state = engine.runner.streams["s"].state.plugin_state
        assert creatures(world, state.last[:, 0]) == [(x0 + 2 * chunk, y0)]
        assert [creatures(world, state.trail[:, i]) for i in range(2)] == [[(x0 + 2 * chunk, y0)]] * 2


def test_a_session_state_with_its_trail_round_trips_and_an_older_one_loads(world):
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=SEED))
    committed(engine, "s", keys("d"))
    plugin = world.plugin
    state = engine.runner.streams["s"].state.plugin_state
    tensors, meta = plugin.state_to_tensors(state)
    back = plugin.state_from_tensors(tensors, meta)
    assert torch.equal(back.trail, state.trail) and torch.equal(back.last, state.last)
    older = plugin.state_from_tensors({k: v for k, v in tensors.items() if k != "trail"}, meta)
    assert older.trail is None and plugin.state_trail(older).shape == state.trail.shape
    with pytest.raises(ValueError, match="creature trail"):
        plugin.state_from_tensors({**tensors, "trail": state.trail[:, :1]}, meta)
    # The atlas's creature memory round-trips; a snapshot from before it loads with an empty one.
    assert torch.equal(back.atlas.creature_at, state.atlas.creature_at)
    assert torch.equal(back.atlas.creature_tags, state.atlas.creature_tags)
    before = plugin.state_from_tensors({k: v for k, v in tensors.items() if "creature_" not in k}, meta)
    assert int((before.atlas.creature_at >= 0).sum()) == 0 and torch.equal(
        before.atlas.cells, state.atlas.cells
    )
    with pytest.raises(ValueError, match="creature memory"):
        plugin.state_from_tensors({**tensors, "atlas.creature_at": state.atlas.creature_at[:8, :8]}, meta)


def test_a_creature_head_is_refused_without_a_creature_layer_or_a_motion_head(world):
    plugin = world.plugin
    motion = plugin.motion
    try:
        plugin.motion = None
        with pytest.raises(ValueError, match="needs a motion head"):
            plugin.bind(world)
    finally:
        plugin.motion = motion
        plugin.bind(world)


def test_a_creature_the_view_leaves_behind_is_there_when_it_comes_back():
    # Creatures stand (the head moves none, meets none, lets none walk in): only the atlas's
    # creature memory can bring one back once its tile has scrolled off the canvas.
    world = walking_world(0)
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=SEED))

    def placed() -> list[tuple[int, int]]:
        """The session's creatures at their pixel on its tile grid (canvas px + its anchor)."""
        state = engine.runner.streams["s"].state.plugin_state
        ox, oy = (8 * state.atlas.origin).tolist()
        return [(x + ox, y + oy) for x, y in creatures(world, state.last[:, 0])]

    start = placed()
    assert len(start) == 1
    for _ in range(14):  # the view walks right until the creature's tile is off the canvas
        committed(engine, "s", keys("d"))
    assert placed() == []
    for _ in range(4):  # and back until it is on again
        committed(engine, "s", keys("a"))
    assert placed() == start

"""A world's motion head in the chunk loop: a key it finds without effect reaches the DiT as not
held, the client's actions are logged as sent, and the committed frames hold the planned motion."""

from __future__ import annotations

import torch

from models.tiny_world.marker import marker_inputs, marker_motion
from models.tiny_world.plugin import TinyWorldPlugin
from models.world import Conditioning, World
from runtime.engine import Engine
from tests.models.tiny_world.test_motion_head import fixed_head
from tests.runtime.conftest import close_frames, committed, keys, small_world


def keyed_world(name: str) -> World:
    """The small image-started world with its keys made to matter: tiny-random's random action
    module moves the frames by about one level, too little to tell a key from none."""
    world = small_world(image_start=True, name=name)
    with torch.no_grad():
        for block in (b for b in world.transformer.blocks if b.action is not None):
            block.action.key_held.mul_(300.0)
            block.action.key_out.weight.mul_(10.0)
    return world


def play(world: World, *chunks: str) -> tuple[list, list]:
    """An image-started stream (seed 5) playing one held key set per chunk: its frames and log."""
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=5))
    frames = [committed(engine, "s", keys(*held) if held else None).frames for held in chunks]
    return frames, list(engine.runner.streams["s"].action_log)


def with_head(name: str, **head: object) -> World:
    world = keyed_world(name)
    world.set_plugin(TinyWorldPlugin(motion=fixed_head(**head)))  # type: ignore[arg-type]
    return world


def test_a_key_without_effect_plays_as_idle_and_is_logged_as_sent():
    walked, log = play(with_head("blocked", effective=False), "d", "d")
    idle, _ = play(with_head("idle", effective=False), "", "")
    assert all(close_frames(a, b) for a, b in zip(walked, idle, strict=True))
    assert all(a.keys == frozenset("d") for chunk in log for a in chunk)
    moving, _ = play(with_head("free", effective=True), "d", "d")
    assert not any(close_frames(a, b) for a, b in zip(moving, idle, strict=True))  # keys matter here


def motion(engine: Engine) -> tuple[list[int], list[int]]:
    """The view's phase and the player's place (x, y) in stream "s"'s latest latent frame."""
    z = engine.runner.streams["s"].state.plugin_state.last
    marker = engine.worlds["m"].plugin.motion.cfg.marker
    values = z[list(marker_inputs(marker)), -1].mean(dim=(1, 2))[None]
    phase, place = marker_motion(values.float(), marker)
    return torch.round(phase[0]).tolist(), torch.round(place[0]).tolist()


def test_committed_chunks_hold_the_planned_motion():
    world = with_head("planned", view=(1, 0), place=(0, 1))
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=5))
    n = world.chunk_frames
    committed(engine, "s", None)
    (px, py), (ox, oy) = motion(engine)
    committed(engine, "s", keys("d"))
    assert motion(engine) == ([px + n, py], [ox, oy + n])

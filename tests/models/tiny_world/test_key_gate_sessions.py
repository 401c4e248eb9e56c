"""A world's key gate in the chunk loop: a key it finds blocked reaches the DiT as not held, the
client's actions are logged as sent, and a gate that finds nothing blocked changes nothing."""

from __future__ import annotations

import torch

from models.tiny_world.key_gate import KeyGate, KeyGateConfig, read_motion
from models.tiny_world.marker import MarkerConfig, marker_inputs
from models.tiny_world.plugin import TinyWorldPlugin
from models.world import Conditioning, World
from runtime.engine import Engine
from tests.runtime.conftest import close_frames, committed, keys, small_world

MOVES = (("d", 0, 1), ("a", 0, -1), ("s", 1, 1), ("w", 1, -1))


def fixed_gate(room: int, scroll: int | None = None) -> KeyGate:
    """A gate that gives every key `room` frames of motion, whatever the frame shows (and, with
    `scroll`, a view head that gives the view that many frames of scrolling: a motion plan)."""
    marker = MarkerConfig(phase=0, place=4, mean=(0.0,) * 6, std=(1.0,) * 6, spatial=4, frame_size=32)
    cfg = KeyGateConfig(
        keys=("w", "a", "s", "d", "space"),
        moves=MOVES,
        in_channels=8,
        marker=marker,
        horizon=2,
        width=8,
        layers=1,
        view=scroll is not None,
    )
    gate = KeyGate(cfg)
    heads = [(gate.out, room)] + ([(gate.view_out, scroll)] if scroll is not None else [])
    with torch.no_grad():
        for out, n in heads:
            out.weight.zero_()
            out.bias.copy_(torch.nn.functional.one_hot(torch.tensor([n] * 4), 3).flatten().float())
    return gate


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


def test_a_blocked_key_plays_as_idle_and_is_logged_as_sent():
    gated = keyed_world("gated")
    gated.set_plugin(TinyWorldPlugin(gate=fixed_gate(room=0)))
    walked, log = play(gated, "d", "d")
    idle, _ = play(keyed_world("plain"), "", "")
    assert all(close_frames(a, b) for a, b in zip(walked, idle, strict=True))
    assert all(a.keys == frozenset("d") for chunk in log for a in chunk)


def test_a_key_with_room_plays_as_without_a_gate():
    gated = keyed_world("gated")
    gated.set_plugin(TinyWorldPlugin(gate=fixed_gate(room=2)))
    with_gate, _ = play(gated, "d", "a")
    without, _ = play(keyed_world("plain"), "d", "a")
    idle, _ = play(keyed_world("plain"), "", "")
    assert all(close_frames(a, b) for a, b in zip(with_gate, without, strict=True))
    assert not any(close_frames(a, b) for a, b in zip(with_gate, idle, strict=True))  # keys matter here


def motion(engine: Engine) -> tuple[list[int], list[int]]:
    """The view's phase and the player's place (x, y) in stream "s"'s latest latent frame."""
    z = engine.runner.streams["s"].state.plugin_state.last
    gate = engine.worlds["m"].plugin.gate
    values = z[list(marker_inputs(gate.cfg.marker)), -1].mean(dim=(1, 2))[None]
    phase, place = read_motion(values, gate.cfg.marker)
    return phase[0].tolist(), place[0].tolist()


def test_a_planned_chunk_is_generated_around_its_pinned_motion():
    """With a view head the committed frames hold the plan: the view scrolls one px a frame while
    the camera has room, then the player walks across it; an idle chunk keeps both."""
    world = keyed_world("planned")
    world.set_plugin(TinyWorldPlugin(gate=fixed_gate(room=2, scroll=2)))
    engine = Engine({"m": world})
    engine.add_stream("s", "m", Conditioning(seed=5))
    n = world.chunk_frames
    committed(engine, "s", None)
    (px, py), (ox, oy) = motion(engine)
    committed(engine, "s", keys("d"))
    assert motion(engine) == ([px + n, py], [ox, oy])
    committed(engine, "s", None)
    assert motion(engine) == ([px + n, py], [ox, oy])
    # The camera stands at the world's edge.
    world.set_plugin(TinyWorldPlugin(gate=fixed_gate(room=2, scroll=0)))
    committed(engine, "s", keys("s"))
    assert motion(engine) == ([px + n, py], [ox, oy + n])

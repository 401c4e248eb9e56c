"""The key gate (models/tiny_world/key_gate.py): which held keys it releases, and how a model directory
carries it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from models.registry import build_world, load_world, save_world, tiny_random_configs
from models.tiny_world.key_gate import KeyGate, KeyGateConfig, read_motion
from models.tiny_world.marker import MarkerConfig
from models.tiny_world.plugin import TinyState, TinyWorldPlugin

KEYS = ("w", "a", "s", "d", "space")
MOVES = (("d", 0, 1), ("a", 0, -1), ("s", 1, 1), ("w", 1, -1))


def gate_cfg(channels: int = 8) -> KeyGateConfig:
    marker = MarkerConfig(phase=0, place=4, mean=(0.0,) * 6, std=(1.0,) * 6, spatial=4, frame_size=32)
    return KeyGateConfig(keys=KEYS, moves=MOVES, in_channels=channels, marker=marker, width=8, layers=1)


def rows(*frames: str) -> torch.Tensor:
    """(1, n, 1, 7) action rows: one frame per string of held keys (space as ' '), no mouse."""
    out = torch.zeros(1, len(frames), 1, len(KEYS) + 2)
    for f, held in enumerate(frames):
        for key in held:
            out[0, f, 0, KEYS.index("space" if key == " " else key)] = 1.0
    return out


def held(actions: torch.Tensor) -> list[str]:
    return [
        "".join(k for i, k in enumerate("wasd ") if actions[0, f, 0, i] > 0) for f in range(actions.shape[1])
    ]


def free(d: int = 4, a: int = 4, s: int = 4, w: int = 4) -> torch.Tensor:
    return torch.tensor([[d, a, s, w]])


def test_a_key_is_released_once_its_room_is_walked():
    gate = KeyGate(gate_cfg())
    assert held(gate.gate(rows("d", "d", "d", "d"), free(d=2))) == ["d", "d", "", ""]
    assert held(gate.gate(rows("d", "d", "d", "d"), free(d=0))) == ["", "", "", ""]
    assert held(gate.gate(rows("d", "d", "d", "d"), free())) == ["d", "d", "d", "d"]
    # Walking back gives the room back; the other axis and space are untouched.
    assert held(gate.gate(rows("d", "d", "a", "a"), free(d=1, a=0))) == ["d", "", "a", ""]
    assert held(gate.gate(rows("wd ", "wd", "wd", "wd"), free(d=1, w=3))) == ["wd ", "w", "w", ""]
    # Opposite keys cancel in the game: nothing moves, nothing is released.
    assert held(gate.gate(rows("ad", "ad", "ad", "ad"), free(d=0, a=0))) == ["ad"] * 4


def test_each_entry_of_a_batch_is_gated_by_its_own_room():
    gate = KeyGate(gate_cfg())
    acts = torch.cat([rows("s", "s", "s"), rows("s", "s", "s")])
    out = gate.gate(acts, torch.cat([free(s=1), free(s=3)]))
    assert held(out[:1]) == ["s", "", ""] and held(out[1:]) == ["s", "s", "s"]
    assert torch.equal(acts, torch.cat([rows("s", "s", "s"), rows("s", "s", "s")]))  # input untouched


def states(*lasts: torch.Tensor | None) -> list[TinyState | None]:
    """Sessions' plug-in states whose latest frames are `lasts` (None: nothing committed)."""
    return [None if z is None else TinyState(z) for z in lasts]


def test_the_config_round_trips_and_refuses_moves_outside_the_keys():
    cfg = gate_cfg()
    assert KeyGateConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="not action keys"):
        KeyGateConfig(keys=("w",), moves=MOVES, in_channels=8, marker=cfg.marker)


def test_a_world_keeps_its_gate_through_its_model_directory(tmp_path: Path):
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    assert world.plugin is None
    torch.manual_seed(1)
    world.set_plugin(TinyWorldPlugin(gate=KeyGate(gate_cfg())))
    assert world.plugin.keeps_last
    save_world(world, tmp_path / "m")
    loaded = load_world(tmp_path / "m")
    assert loaded.plugin.gate is not None and loaded.plugin.gate.cfg == world.plugin.gate.cfg
    mine, theirs = world.plugin.gate.state_dict(), loaded.plugin.gate.state_dict()
    for (k, a), b in zip(mine.items(), theirs.values(), strict=True):
        assert torch.equal(a, b), k


def test_a_gate_must_read_the_worlds_keys_and_latents():
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    with pytest.raises(ValueError, match="latent channels"):
        world.set_plugin(TinyWorldPlugin(gate=KeyGate(gate_cfg(channels=12))))
    cfg = gate_cfg()
    cfg.keys = ("w", "a", "s", "d")
    with pytest.raises(ValueError, match="keys"):
        world.set_plugin(TinyWorldPlugin(gate=KeyGate(cfg)))


def test_steer_leaves_entries_without_a_latest_frame_alone():
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    acts = torch.cat([rows("d", "d"), rows("d", "d")])
    assert TinyWorldPlugin().steer(acts, [None, None]) == (acts, None)  # no gate
    gate = KeyGate(gate_cfg())
    with torch.no_grad():
        gate.out.weight.zero_()
        gate.out.bias.copy_(torch.tensor([1.0, 0, 0, 0, 0] * 4))  # every key: no room
    world.set_plugin(TinyWorldPlugin(gate=gate))
    z = torch.zeros(8, 1, 16, 16)
    out, pins = world.plugin.steer(acts, states(z, None))
    assert held(out[:1]) == ["", ""] and held(out[1:]) == ["d", "d"]
    assert pins is None  # a gate without a view head plans nothing


# -- the motion plan (`KeyGate.plan`) --------------------------------------------------------------


def view_gate(room: int = 4, scroll: int = 4) -> KeyGate:
    """A view-headed gate that finds `room` frames of motion and `scroll` of the view's, for every
    key, whatever the frame shows."""
    cfg = gate_cfg()
    cfg.view = True
    gate = KeyGate(cfg)
    with torch.no_grad():
        for out, n in ((gate.out, room), (gate.view_out, scroll)):
            out.weight.zero_()
            out.bias.copy_(torch.nn.functional.one_hot(torch.tensor([n] * 4), 5).flatten().float())
    return gate


def latest(phase: tuple[int, int], place: tuple[int, int], s: int = 4, scale: float = 4.0) -> torch.Tensor:
    """(1, 8, 6, 6) latents whose marker channels (gate_cfg: phase 0-3, place 4-5, raw = z) put
    the view at `phase` px on its canvas and the player `place` px off the view's centre."""
    z = torch.randn(1, 8, 6, 6)
    for axis, p in enumerate(phase):
        z[0, 2 * axis] = math.cos(p * math.pi / s)
        z[0, 2 * axis + 1] = math.sin(p * math.pi / s)
    z[0, 4], z[0, 5] = place[0] / scale, place[1] / scale
    return z


def planned(gate: KeyGate, z: torch.Tensor, acts: torch.Tensor, scroll: torch.Tensor) -> tuple[list, list]:
    """The plan's view phase and player place per frame, as [(x, y), ...] whole px."""
    phase, place = read_motion(gate.plan(acts, scroll, z), gate.cfg.marker)
    as_list = lambda t: [tuple(int(v) for v in t[0, :, f]) for f in range(t.shape[2])]  # noqa: E731
    return as_list(phase), as_list(place)


def test_a_centred_player_with_room_scrolls_the_view():
    gate = view_gate()
    phase, place = planned(gate, latest((1, 2), (0, 0)), rows("d", "d", "ds", ""), free())
    assert phase == [(2, 2), (3, 2), (4, 3), (4, 3)]  # one px a frame along each held axis
    assert place == [(0, 0)] * 4


def test_at_the_worlds_edge_the_player_walks_across_the_view():
    gate = view_gate()
    # One frame of room to the right: the view scrolls once, then stands while the player walks.
    phase, place = planned(gate, latest((0, 0), (0, 0)), rows("d", "d", "d", "d"), free(d=1))
    assert phase == [(1, 0)] * 4
    assert place == [(0, 0), (1, 0), (2, 0), (3, 0)]
    # Off-centre (the camera stopped at the left edge): walking on out moves the player, walking
    # back moves it to the centre first and only then scrolls the view.
    phase, place = planned(gate, latest((0, 0), (-2, 0)), rows("a", "d", "d", "d"), free(a=0))
    assert place == [(-3, 0), (-2, 0), (-1, 0), (0, 0)]
    assert phase == [(0, 0)] * 4
    phase, place = planned(gate, latest((0, 0), (-1, 0)), rows("d", "d", "d", ""), free(a=0))
    assert place == [(0, 0)] * 4 and phase == [(0, 0), (1, 0), (2, 0), (2, 0)]


def test_idle_and_blocked_frames_hold_the_view_and_the_player():
    gate = view_gate()
    z = latest((3, -1), (5, -2))
    phase, place = planned(gate, z, rows("", " ", "", ""), free())
    assert phase == [(3, -1)] * 4 and place == [(5, -2)] * 4
    # Opposite keys cancel, as in the game.
    assert planned(gate, z, rows("ad", "ws", "ad", "ad"), free()) == ([(3, -1)] * 4, [(5, -2)] * 4)


def test_a_view_gate_pins_the_plan_into_every_estimate():
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    world.set_plugin(TinyWorldPlugin(gate=view_gate()))
    acts = torch.cat([rows("d", "d"), rows("d", "d")])
    z = latest((0, 0), (0, 0))[0, :, None]  # (C, 1, h, w)
    out, pins = world.plugin.steer(acts, states(z, None))
    assert pins is not None and pins.rows.tolist() == [True, False]
    x = torch.randn(2, 8, 2, 6, 6)
    before = x.clone()
    pins.apply(x)
    phase, place = read_motion(x[:, list(pins.channels)].mean(dim=(3, 4)), world.plugin.gate.cfg.marker)
    assert held(out) == ["d", "d"]
    assert phase[0, 0].tolist() == [1, 2] and place[0].abs().sum() == 0
    assert torch.equal(x[1], before[1])  # no plan: the entry keeps its own estimate
    others = [c for c in range(8) if c not in pins.channels]
    assert torch.equal(x[:, others], before[:, others])
    # At the world's edge the same keys walk the player instead.
    world.set_plugin(TinyWorldPlugin(gate=view_gate(scroll=0)))
    x = torch.randn(2, 8, 2, 6, 6)
    world.plugin.steer(acts, states(z, None))[1].apply(x)
    phase, place = read_motion(x[:1, list(pins.channels)].mean(dim=(3, 4)), world.plugin.gate.cfg.marker)
    assert phase.abs().sum() == 0 and place[0, 0].tolist() == [1, 2]

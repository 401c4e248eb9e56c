"""The key gate (models/key_gate.py): which held keys it releases, and how a model directory
carries it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.causal_wan import MarkerConfig
from models.key_gate import KeyGate, KeyGateConfig
from models.registry import build_world, load_world, save_world, tiny_random_configs

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


def test_the_config_round_trips_and_refuses_moves_outside_the_keys():
    cfg = gate_cfg()
    assert KeyGateConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="not action keys"):
        KeyGateConfig(keys=("w",), moves=MOVES, in_channels=8, marker=cfg.marker)


def test_a_world_keeps_its_gate_through_its_model_directory(tmp_path: Path):
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    assert not world.keeps_last
    torch.manual_seed(1)
    world.set_gate(KeyGate(gate_cfg()))
    assert world.keeps_last
    save_world(world, tmp_path / "m")
    loaded = load_world(tmp_path / "m")
    assert loaded.gate is not None and loaded.gate.cfg == world.gate.cfg
    for (k, a), b in zip(world.gate.state_dict().items(), loaded.gate.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_a_gate_must_read_the_worlds_keys_and_latents():
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    with pytest.raises(ValueError, match="latent channels"):
        world.set_gate(KeyGate(gate_cfg(channels=12)))
    cfg = gate_cfg()
    cfg.keys = ("w", "a", "s", "d")
    with pytest.raises(ValueError, match="keys"):
        world.set_gate(KeyGate(cfg))


def test_gate_actions_leaves_entries_without_a_latest_frame_alone():
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    acts = torch.cat([rows("d", "d"), rows("d", "d")])
    assert world.gate_actions(acts, [None, None]) is acts  # no gate
    gate = KeyGate(gate_cfg())
    with torch.no_grad():
        gate.out.weight.zero_()
        gate.out.bias.copy_(torch.tensor([1.0, 0, 0, 0, 0] * 4))  # every key: no room
    world.set_gate(gate)
    z = torch.zeros(8, 1, 16, 16)
    out = world.gate_actions(acts, [z, None])
    assert held(out[:1]) == ["", ""] and held(out[1:]) == ["d", "d"]

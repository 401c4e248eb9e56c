"""The learned motion head (models/tiny_world/motion_head.py): how it rolls a chunk's motion out,
which keys it releases, what it pins, what it learns from labels alone, and how a model directory
carries it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from models.registry import build_world, load_world, save_world, tiny_random_configs
from models.tiny_world.marker import MarkerConfig, marker_motion
from models.tiny_world.motion_head import MotionHead, MotionHeadConfig
from models.tiny_world.plugin import TinyState, TinyWorldPlugin, load_plugin
from models.tiny_world.training.motion import MotionTraining, motion_labels, train_motion

KEYS = ("w", "a", "s", "d", "space")


def head_cfg(channels: int = 8) -> MotionHeadConfig:
    marker = MarkerConfig(phase=0, place=4, mean=(0.0,) * 6, std=(1.0,) * 6, spatial=4, frame_size=32)
    return MotionHeadConfig(keys=KEYS, in_channels=channels, marker=marker, width=8, layers=1, hidden=16)


def fixed_head(
    view: tuple[int, int] = (0, 0), place: tuple[int, int] = (0, 0), effective: bool = True
) -> MotionHead:
    """A head that moves the view and the player by the same px every frame, whatever it reads,
    and finds every key with (or without) effect."""
    head = MotionHead(head_cfg())
    c, m = head.cfg.classes, head.cfg.max_step
    bias = torch.zeros(4 * c + len(KEYS))
    for slot, move in enumerate((*view, *place)):
        bias[slot * c + move + m] = 50.0
    bias[4 * c :] = 50.0 if effective else -50.0
    with torch.no_grad():
        head.step_out.weight.zero_()
        head.step_out.bias.copy_(bias)
    return head


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


def latest(phase: tuple[int, int], place: tuple[int, int], s: int = 4, scale: float = 4.0) -> torch.Tensor:
    """(1, 8, 6, 6) latents whose marker channels (phase 0-3, place 4-5, raw = z) put the view at
    `phase` px on its canvas and the player `place` px off the view's centre."""
    z = torch.randn(1, 8, 6, 6)
    for axis, p in enumerate(phase):
        z[0, 2 * axis] = math.cos(p * math.pi / s)
        z[0, 2 * axis + 1] = math.sin(p * math.pi / s)
    z[0, 4], z[0, 5] = place[0] / scale, place[1] / scale
    return z


def read(values: torch.Tensor, head: MotionHead) -> tuple[list, list]:
    """Pinned values (1, 6, n) -> the view's phase and the player's place per frame, whole px."""
    phase, place = marker_motion(values.float(), head.cfg.marker)
    as_list = lambda t: [tuple(round(float(v)) for v in t[0, :, f]) for f in range(t.shape[2])]  # noqa: E731
    return as_list(phase), as_list(place)


def test_the_config_round_trips():
    cfg = head_cfg()
    assert MotionHeadConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="max_step"):
        MotionHeadConfig(keys=KEYS, in_channels=8, marker=cfg.marker, max_step=0)


def test_the_plan_accumulates_the_predicted_moves_from_the_latest_frame():
    head = fixed_head(view=(1, 0), place=(0, -1))
    _, pins = head.steer(rows("d", "d", "d", "d"), latest((1, 2), (3, 0)))
    phase, place = read(pins, head)
    assert phase == [(2, 2), (3, 2), (4, 2), (5, 2)]
    assert place == [(3, -1), (3, -2), (3, -3), (3, -4)]


def test_keys_without_effect_are_released_and_the_rest_kept():
    head = fixed_head(effective=False)
    acts = rows("d", "wd ", "", "a")
    out, _ = head.steer(acts, latest((0, 0), (0, 0)))
    assert held(out) == ["", "", "", ""]
    assert out[..., len(KEYS) :].equal(acts[..., len(KEYS) :])  # non-key columns untouched
    out, _ = fixed_head(effective=True).steer(acts, latest((0, 0), (0, 0)))
    assert held(out) == held(acts)


def test_a_zeroed_head_moves_nothing_and_releases_nothing():
    """The ablation: every weight zero gives a uniform distribution over symmetric moves (expected
    move 0) and effect logits of 0 (kept)."""
    head = MotionHead(head_cfg())
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
    acts = rows("d", "d", "s", "a")
    out, pins = head.steer(acts, latest((1, 1), (2, 0)))
    assert held(out) == held(acts)
    assert read(pins, head) == ([(1, 1)] * 4, [(2, 0)] * 4)


def test_the_head_learns_each_keys_direction_and_a_wall_from_labels_alone():
    """Labels only: 'd' moved the view +1 px a frame and 'a' -1, except where channel 7 of the
    latest frame is set (a wall to the right), where 'd' moved nothing. No direction or speed is
    written into the head."""
    torch.manual_seed(0)
    e, n_frames = 64, 17
    gen = torch.Generator().manual_seed(0)
    keys = torch.zeros(e, n_frames, len(KEYS) + 2)
    choice = torch.randint(0, 3, (e, n_frames), generator=gen)  # 0 idle, 1 d, 2 a
    keys[..., KEYS.index("d")] = (choice == 1).float()
    keys[..., KEYS.index("a")] = (choice == 2).float()
    wall = torch.rand(e, generator=gen) < 0.5
    z = torch.zeros(e, n_frames, 8, 6, 6)
    z[:, :, 0], z[:, :, 2] = 1.0, 1.0  # phase 0 on both axes
    z[wall, :, 7] = 1.0
    step = keys[..., KEYS.index("d")] * (~wall[:, None]).float() - keys[..., KEYS.index("a")]
    step[:, 0] = 0
    cams = torch.stack([step.cumsum(1), torch.zeros(e, n_frames)], -1)
    players = torch.full((e, n_frames, 2), 16.0)
    head, record = train_motion(
        head_cfg(),
        z,
        keys,
        cams,
        players,
        MotionTraining(steps=300, batch=64, lr=1e-2, noise=0.0),
        progress=False,
    )
    assert record["plan_accuracy"] > 0.95
    free, blocked = z[~wall][0, 0][None], z[wall][0, 0][None]
    _, pins = head.steer(rows("d", "d", "a", ""), free)
    assert read(pins, head)[0] == [(1, 0), (2, 0), (1, 0), (1, 0)]
    out, pins = head.steer(rows("d", "d", "a", ""), blocked)
    assert read(pins, head)[0] == [(0, 0), (0, 0), (-1, 0), (-1, 0)]
    assert held(out) == ["", "", "a", ""]  # the blocked key released, the free one kept


def test_labels_are_what_the_episode_did():
    acts = torch.zeros(1, 4, len(KEYS))
    acts[0, 1:, KEYS.index("d")] = 1.0  # d held in frames 1-3
    cams = torch.tensor([[[0.0, 0], [1, 0], [1, 0], [1, 0]]])  # the camera stops after one px
    players = torch.tensor([[[32.0, 32], [32, 32], [33, 32], [33, 32]]])  # then the player walks one
    lab = motion_labels(acts, cams, players, 3)
    assert lab.view[0, :, 0].tolist() == [1, 0, 0] and lab.place[0, :, 0].tolist() == [0, 1, 0]
    assert lab.effective[0, :, KEYS.index("d")].tolist() == [1.0, 1.0, 0.0]  # frame 3: a wall
    assert lab.view_before[0, :, 0].tolist() == [0, 1, 1] and lab.place_before[0, :, 0].tolist() == [0, 0, 1]


def states(*lasts: torch.Tensor | None) -> list[TinyState | None]:
    return [None if z is None else TinyState(z) for z in lasts]


def test_the_plugin_pins_the_plan_for_entries_with_a_latest_frame_only():
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    acts = torch.cat([rows("d", "d"), rows("d", "d")])
    assert TinyWorldPlugin().steer(acts, [None, None]) == (acts, None)  # no head
    world.set_plugin(TinyWorldPlugin(motion=fixed_head(view=(1, 0), effective=False)))
    out, pins = world.plugin.steer(acts, states(latest((0, 0), (0, 0))[0, :, None], None))
    assert held(out[:1]) == ["", ""] and held(out[1:]) == ["d", "d"]
    assert pins is not None and pins.rows.tolist() == [True, False]
    x = torch.randn(2, 8, 2, 6, 6)
    before = x.clone()
    pins.apply(x)
    phase, _ = marker_motion(x[:, list(pins.channels)].mean(dim=(3, 4)), world.plugin.motion.cfg.marker)
    assert torch.round(phase[0, 0]).tolist() == [1, 2]
    assert torch.equal(x[1], before[1])  # no plan: the entry keeps its own estimate
    others = [c for c in range(8) if c not in pins.channels]
    assert torch.equal(x[:, others], before[:, others])


def test_a_world_keeps_its_head_through_its_model_directory(tmp_path: Path):
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    torch.manual_seed(1)
    world.set_plugin(TinyWorldPlugin(motion=MotionHead(head_cfg())))
    assert world.plugin.keeps_last
    save_world(world, tmp_path / "m")
    loaded = load_world(tmp_path / "m")
    assert loaded.plugin.motion is not None and loaded.plugin.motion.cfg == world.plugin.motion.cfg
    mine, theirs = world.plugin.motion.state_dict(), loaded.plugin.motion.state_dict()
    for (k, a), b in zip(mine.items(), theirs.values(), strict=True):
        assert torch.equal(a, b), k


def test_a_key_gate_from_before_is_refused_with_the_command_that_replaces_it(tmp_path: Path):
    with pytest.raises(ValueError, match=re.escape("python -m models.tiny_world.motion --model")):
        load_plugin(tmp_path, {"name": "tiny_world", "gate": {}})


def test_a_head_must_read_the_worlds_keys_and_latents():
    world_cfg, dit, vae = tiny_random_configs()
    world = build_world(world_cfg, dit, vae, seed=0)
    with pytest.raises(ValueError, match="latent channels"):
        world.set_plugin(TinyWorldPlugin(motion=MotionHead(head_cfg(channels=12))))
    cfg = head_cfg()
    cfg.keys = ("w", "a", "s", "d")
    with pytest.raises(ValueError, match="keys"):
        world.set_plugin(TinyWorldPlugin(motion=MotionHead(cfg)))

"""The focus episodes (`sf_focus`, `FOCUS_POLICY`): long idle stretches and walks into walls,
encoded and blurred like the training episodes, cached, and drawn by the sf stage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.game import random_policy
from models.tiny_world.data import FOCUS_POLICY, action_rows, make_episodes
from models.tiny_world.training.clips import idle_clips
from tests.models.tiny_world.test_train_cli import train_tiny


def _shares(policy: dict | None) -> tuple[float, float]:
    """(idle share of frames, share of key-held frames where the view does not move)."""
    eps = make_episodes(list(range(640, 656)), 160, policy=policy)
    moving = eps.actions[:, 1:, :4].any(-1)
    still = np.abs(np.diff(eps.cameras, axis=1)).sum(-1) == 0
    return float((~moving).mean()), float((still & moving).sum() / moving.sum())


def test_focus_episodes_idle_longer_and_meet_more_walls():
    idle, blocked = _shares(None)
    f_idle, f_blocked = _shares(FOCUS_POLICY)
    assert f_idle > 2 * idle
    assert f_blocked > 1.4 * blocked


def test_the_sf_stage_encodes_caches_and_draws_focus_episodes(tmp_path: Path):
    out = tmp_path / "run"
    sf = ["--sf-steps", "3", "--sf-batch", "4", "--sf-focus", "1", "--sf-focus-episodes", "3"]
    logged = train_tiny(out, *sf)
    assert len(logged) == 3 and all(np.isfinite(r["loss"]) for r in logged)
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "focus.safetensors"), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    n = config["episode_frames"]
    first = config["world_seed_base"] + config["episodes"]  # the worlds after the training ones
    assert tensors["latents"].shape[:2] == (3, n + 1)
    assert tensors["blurred"].shape == tensors["latents"].shape
    assert not torch.equal(tensors["blurred"], tensors["latents"])
    for i in range(3):
        keys = random_policy(first + i, n, **FOCUS_POLICY)
        assert torch.equal(tensors["actions"][i], torch.from_numpy(action_rows(keys)))
    assert json.loads(meta["policy"]) == FOCUS_POLICY and meta["episodes"] == "3"
    # A second run with the same settings reads the cache instead of re-encoding it, and with
    # sf_focus 1 draws no training episode: their blurred history, made NaN, is never read.
    again = tmp_path / "again"
    again.mkdir()
    for name in ("latents.safetensors", "focus.safetensors"):
        (again / name).write_bytes((out / name).read_bytes())
    with safe_open(str(out / "blurred.safetensors"), "pt") as f:
        blurred_meta, blurred = f.metadata(), f.get_tensor("latents")
    save_file(
        {"latents": torch.full_like(blurred, float("nan"))}, str(again / "blurred.safetensors"), blurred_meta
    )
    stamp = (again / "focus.safetensors").stat().st_mtime_ns
    assert [r["loss"] for r in train_tiny(again, *sf)] == [r["loss"] for r in logged]
    assert (again / "focus.safetensors").stat().st_mtime_ns == stamp


def test_without_focus_no_focus_episodes_are_made(tmp_path: Path):
    train_tiny(tmp_path / "run")
    assert not (tmp_path / "run" / "focus.safetensors").exists()


def test_idle_clips_are_those_without_a_key_after_the_start():
    rows = torch.zeros(3, 9, 1, 5)
    rows[0, 0, 0, 3] = 1.0  # a key on the start frame only: still idle (served as idle anyway)
    rows[1, 8, 0, 4] = 1.0  # space in the last frame
    assert idle_clips(rows).tolist() == [True, False, True]


def test_idle_clips_roll_out_their_own_history(tmp_path: Path):
    sf = ["--sf-steps", "4", "--sf-batch", "8", "--sf-focus", "1", "--sf-focus-episodes", "3"]
    logged = train_tiny(tmp_path / "run", *sf, "--sf-self-idle", "1", "--sf-clip-chunks", "1")
    assert any(r["self_rolled"] > 0 for r in logged)
    assert all((r["history_mse"] > 0) == (r["self_rolled"] > 0) for r in logged)
    assert all(r["idle_lead"] == 0 for r in logged)
    # With a lead the idle rollouts first run 0..3 idle chunks (4 frames each) of their own.
    led = train_tiny(
        tmp_path / "lead", *sf, "--sf-self-idle", "1", "--sf-clip-chunks", "1", "--sf-idle-lead", "3"
    )
    leads = {r["idle_lead"] for r in led if r["self_rolled"] > 0}
    assert leads <= {0, 4, 8, 12} and leads - {0}

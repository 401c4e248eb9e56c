"""The training run's `motion` stage: it exports a model directory whose world carries the motion
head (and, after it, the terrain prior), and a run without the sprite layer it reads is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.registry import load_world
from models.tiny_world import ATLAS_TILES
from tests.models.tiny_world.test_motion_weights import TILED
from tests.models.tiny_world.test_train_cli import train_tiny


def test_the_motion_and_terrain_stages_export_a_world_with_both(tmp_path: Path):
    train_tiny(tmp_path / "run", *TILED, "--episodes", "4", "--motion-steps", "3", "--terrain-steps", "2")
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    (record,) = [r for r in log if r["stage"] == "motion"]
    assert (
        0.0 <= record["plan_accuracy"] <= 1.0 and record["plan_frames"] == 1 * 4 * 4
    )  # one held-out episode
    (terrain,) = [r for r in log if r["stage"] == "terrain"]
    assert terrain["examples"] == 8192 and terrain["cross_entropy"] > 0
    world = load_world(tmp_path / "run" / "model")
    plugin = world.plugin
    assert plugin.motion is not None and plugin.keeps_last
    assert plugin.settings.carry_channels == ()  # served as the last DiT stage (sf, no carry) trained it
    assert plugin.remembers and plugin.settings.atlas_tiles == ATLAS_TILES  # its head files the tiles
    assert plugin.terrain is not None and plugin.cartographer.prior is plugin.terrain
    assert plugin.terrain.cfg.classes == len(world.decoder.ae.cfg.codebook)
    # The `ae` stage fit the codebook on its frames (these few frames show only some colours).
    (fit,) = [r for r in log if "codebook" in r]
    assert fit["stage"] == "ae" and fit["codebook"] == world.decoder.ae.cfg.codebook
    assert 2 <= len(fit["codebook"]) <= 8 and fit["flat_cells"] > 0


def test_a_run_without_a_sprite_layer_asks_for_no_motion_head(tmp_path: Path, capsys):
    from models.tiny_world.train import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "run"), "--ae-sprite", "false"])
    assert "--motion-steps 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written

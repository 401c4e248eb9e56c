"""The shipped tiny world: its files match the model card's sha256, it loads as the default model,
and a short rollout through the Engine follows a held key (coarse: the direction of motion)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict

import numpy as np
import pytest
import torch

from models.actions import FrameAction
from models.registry import DEFAULT_MODEL, from_name
from models.tiny_world import (
    ATLAS_TILES,
    SERVE_STEPS,
    TRAIN_SCHEDULE,
    WEIGHTS_DIR,
    ae_config,
    atlas_tiles,
    creature_channels,
    view_channels,
    world_config,
)
from models.tiny_world.metrics import KEY_AXES, free_worlds, world_displacement
from models.tiny_world.training.config import TrainConfig
from models.tiny_world.training.creatures import creature_config
from models.tiny_world.training.motion import motion_config
from models.tiny_world.training.prior import terrain_config
from models.tiny_world.training.trainer import Trainer
from models.world import Conditioning
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest

CARD = WEIGHTS_DIR.parent / "MODEL_CARD.md"
ROW = re.compile(r"^\|\s*`(?P<file>[^`]+)`\s*\|\s*(?P<bytes>\d+)\s*\|\s*`(?P<sha>[0-9a-f]{64})`\s*\|", re.M)


def test_weight_files_match_the_model_card():
    rows = {m["file"]: (int(m["bytes"]), m["sha"]) for m in ROW.finditer(CARD.read_text())}
    files = sorted(str(p.relative_to(WEIGHTS_DIR)) for p in WEIGHTS_DIR.rglob("*") if p.is_file())
    assert files and sorted(rows) == files
    total = 0
    for name, (size, sha) in rows.items():
        data = (WEIGHTS_DIR / name).read_bytes()
        assert len(data) == size, name
        assert hashlib.sha256(data).hexdigest() == sha, name
        total += size
    assert total <= 25 * 2**20


@pytest.fixture(scope="module")
def world():
    return from_name("tiny-world")


def test_the_trainers_defaults_build_the_shipped_model(world, tmp_path):
    # `python -m models.tiny_world.train --out DIR` with no flags is the shipped recipe (model card)
    cfg = TrainConfig()
    recipe = {"ae_tiled": True, "ae_sprite": True, "dit_steps": 2000, "sf_steps": 250, "sf_blur": 0.0}
    assert {k: getattr(cfg, k) for k in recipe} == recipe and cfg.sf_sprite_jitter == 4
    second = {"sf2_steps": 500, "sf2_view_start": True, "sf2_jitter_centred": True}
    assert {k: getattr(cfg, k) for k in second} == second
    assert (cfg.sf3_steps, cfg.sf3_phase_weight) == (250, 2.0) and cfg.dit_stages()[-1] == "sf3"
    assert cfg.sf3_release_blocked and cfg.motion_steps == 8000
    # The terrain prior (row BN): the `terrain` stage's, on the autoencoder's codebook (fit on
    # frames by the `ae` stage, as many entries as the recipe asks).
    assert cfg.terrain_steps == 3000 and world.plugin.terrain is not None
    assert len(world.decoder.ae.cfg.codebook) == cfg.codebook_size == 8
    assert world.plugin.terrain.cfg == terrain_config(world.decoder.ae.cfg.codebook)
    assert world.plugin.cartographer.prior is world.plugin.terrain
    # The motion head reads the latents the DiT makes and plans one chunk's motion.
    assert world.plugin.motion is not None and world.plugin.motion.cfg == motion_config(world.decoder.ae)
    assert world.plugin.motion.cfg.horizon == world.chunk_frames
    # The creature layer (issue 41): in the autoencoder, the DiT's 18 channels, carried when served.
    assert cfg.ae_creatures and cfg.sf_creature_start and cfg.creature_weight == 4.0
    assert world.decoder.ae.cfg.creatures and world.transformer.cfg.in_channels == 18
    # The creature head (issue 41): the `creatures` stage's, walking a chunk's frames.
    assert cfg.creature_steps == 4000 and world.plugin.creatures is not None
    assert world.plugin.creatures.cfg == creature_config(world.decoder.ae)
    assert world.plugin.creatures.cfg.horizon == world.chunk_frames
    trainer = Trainer(cfg, tmp_path, None, progress=False)
    assert trainer.ae.cfg == ae_config(True, True, True) and trainer.dit.cfg == world.transformer.cfg
    # Served as its last phase trained: the view's phase and the creatures carried from the latest frame.
    carried = world.plugin.settings.carry_channels
    assert carried == trainer.carried("sf3") == tuple(sorted(view_channels() + creature_channels()))
    assert world.plugin.settings.atlas_tiles == atlas_tiles(world.plugin.motion) == ATLAS_TILES
    assert world.plugin.remembers
    # Trained on TRAIN_SCHEDULE, served without its 500 step (model card, experiment BM).
    assert world.config.schedule == world_config().schedule
    assert world.config.schedule.steps == SERVE_STEPS and set(SERVE_STEPS) < set(TRAIN_SCHEDULE.steps)
    stats = {"latents_mean", "latents_std", "codebook"}  # what the `ae` stage fits after training
    shipped = {k: v for k, v in asdict(world.decoder.ae.cfg).items() if k not in stats}
    assert {k: v for k, v in asdict(trainer.ae.cfg).items() if k not in stats} == shipped
    assert trainer.dit.cfg == world.transformer.cfg


def test_default_model_is_the_tiny_world(world):
    assert DEFAULT_MODEL == "tiny-world"
    assert world.config.image_start and world.spec.width == world.spec.height == 64
    assert world.action_space.keys == ("w", "a", "s", "d", "space") and not world.action_space.mouse


@torch.no_grad()
@pytest.mark.parametrize(("key", "axis", "sign"), KEY_AXES)
def test_rollout_follows_a_held_key(world, key, axis, sign):
    n_chunks = 3
    n = n_chunks * world.spec.chunk_frames
    seeds = free_worlds(4, n, 1_000_000)  # the simulator scrolls the view n px in each of them

    engine = Engine({world.config.id: world}, max_batch=len(seeds))
    parts: dict[str, dict[int, np.ndarray]] = {}
    for seed in seeds:
        sid = str(seed)
        start = engine.add_stream(sid, world.config.id, Conditioning(seed=seed)).frame
        parts[sid] = {0: start[None]}
        for _ in range(n_chunks):
            engine.submit(ChunkRequest(sid, engine.new_request_id(), actions=[FrameAction(frozenset({key}))]))
    while engine.has_work():
        for o in engine.step():
            assert isinstance(o, ChunkCommitted)
            parts[o.stream_id][o.frame0] = o.frames
    along, across = [], []
    for sid, chunks in parts.items():
        frames = np.concatenate([chunks[k] for k in sorted(chunks)])
        assert frames.shape == (n + 1, 64, 64, 3), sid
        along.append(float(world_displacement(frames, axis)[-1]) * sign)
        across.append(abs(float(world_displacement(frames, 1 - axis)[-1])))
    # Coarse on purpose: the model moves slower than the game (see MODEL_CARD.md), but a held key
    # must move the view its way, more than across it.
    assert np.mean(along) >= 0.25 * n, f"held {key!r}: view moved {along} px, the game {n} px"
    assert np.mean(across) <= 0.5 * np.mean(along), f"held {key!r}: {across} px across the key's axis"

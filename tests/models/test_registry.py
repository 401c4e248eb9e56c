"""Model directories round-trip through save_world/load_world for both decoder kinds, with the
decoder kind and the start image declared in worldserve.json; tiny-random still builds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from models.fast_decoder import FastAEConfig, FastStreamingDecoder
from models.registry import (
    REGISTRY,
    build_world,
    from_name,
    load_world,
    save_world,
    start_image_fn,
    tiny_random_configs,
)
from models.vae import WanStreamingVAE
from models.world import Conditioning

SMALL_AE = FastAEConfig(
    latent_channels=8, spatial=4, enc_channels=(4, 8, 8), dec_channels=(8, 8, 4), dec_up_blocks=(1, 0)
)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_fast_decoder_world_round_trips(tmp_path: Path):
    world_cfg, dit, _ = tiny_random_configs()
    world_cfg = replace(world_cfg, id="fast", image_start=True)
    dit = replace(dit, action=replace(dit.action, frames_per_latent=1))
    world = build_world(world_cfg, dit, SMALL_AE, seed=1, decoder="fast")
    world.decoder.ae.set_normalisation(torch.arange(8.0), torch.full((8,), 2.0))
    save_world(world, tmp_path, start_image={"kind": "game", "size": 64})
    meta = json.loads((tmp_path / "worldserve.json").read_text())
    assert meta["decoder"] == {"kind": "fast"} and meta["start_image"]["kind"] == "game"

    loaded = load_world(tmp_path)
    assert isinstance(loaded.decoder, FastStreamingDecoder)
    assert loaded.decoder.ae.cfg == world.decoder.ae.cfg
    assert same_weights(loaded.transformer, world.transformer)
    assert same_weights(loaded.decoder.ae, world.decoder.ae)
    state = loaded.init_state(Conditioning(seed=7))  # the start image comes from the game
    assert state.start_latents.shape == (8, 1, 16, 16)
    assert from_name(str(tmp_path)).config.id == "fast"


def test_wan_world_round_trips_and_defaults_to_the_wan_decoder(tmp_path: Path):
    world = from_name("tiny-random")
    assert isinstance(world.decoder, WanStreamingVAE)
    _, _, vae = tiny_random_configs()
    save_world(world, tmp_path, vae)
    meta = json.loads((tmp_path / "worldserve.json").read_text())
    del meta["decoder"]  # directories written before decoder kinds existed
    (tmp_path / "worldserve.json").write_text(json.dumps(meta))
    loaded = load_world(tmp_path)
    assert isinstance(loaded.decoder, WanStreamingVAE)
    assert same_weights(loaded.decoder.vae, world.decoder.vae)
    assert "tiny-world" in REGISTRY and "tiny-random" in REGISTRY


def test_start_image_kinds():
    assert start_image_fn(None) is None
    frame = start_image_fn({"kind": "game", "size": 64})(3)
    assert frame.shape == (64, 64, 3) and frame.dtype == np.uint8
    with pytest.raises(ValueError, match="start_image kind"):
        start_image_fn({"kind": "webcam"})

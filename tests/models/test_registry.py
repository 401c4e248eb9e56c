"""Model directories round-trip through save_world/load_world for every decoder kind, with the
decoder kind and the start image declared in worldserve.json; tiny-random still builds; a loaded
world takes TAEHV weights from a local file (`with_decoder`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models.registry import (
    build_world,
    from_name,
    list_models,
    load_world,
    register,
    registered,
    save_world,
    start_image_fn,
    tiny_random_configs,
    with_decoder,
)
from models.taehv import TAEHV, TAEHVConfig, TAEHVDecoder
from models.tiny_world.fast_decoder import FastAEConfig, FastStreamingDecoder
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
    assert "tiny-world" in list_models() and "tiny-random" in list_models()


def test_start_image_kinds():
    assert start_image_fn(None) is None
    frame = start_image_fn({"kind": "game", "size": 64})(3)
    assert frame.shape == (64, 64, 3) and frame.dtype == np.uint8
    with pytest.raises(ValueError, match="start_image kind"):
        start_image_fn({"kind": "webcam"})


TINY_TAEHV = TAEHVConfig(
    latent_channels=8,
    enc_width=8,
    enc_time_down=(True, False, False),
    dec_widths=(8, 8, 8, 8),
    dec_time_up=(False, False, True),
    blocks=1,
)


def test_taehv_world_round_trips_and_reads_weights_from_a_path(tmp_path: Path):
    world_cfg, dit, _ = tiny_random_configs()
    world = build_world(replace(world_cfg, id="taehv"), dit, TINY_TAEHV, seed=2, decoder="taehv")
    save_world(world, tmp_path / "dir")
    meta = json.loads((tmp_path / "dir" / "worldserve.json").read_text())
    assert meta["decoder"]["kind"] == "taehv" and "path" not in meta["decoder"]
    assert TAEHVConfig.from_dict(meta["decoder"]["config"]) == TINY_TAEHV
    loaded = load_world(tmp_path / "dir")
    assert isinstance(loaded.decoder, TAEHVDecoder) and loaded.decoder.model.cfg == TINY_TAEHV
    assert same_weights(loaded.decoder.model, world.decoder.model)
    # weights elsewhere, named by "path" (absolute here; relative paths are read from the directory)
    (tmp_path / "dir" / "vae" / "diffusion_pytorch_model.safetensors").rename(tmp_path / "w.safetensors")
    meta["decoder"]["path"] = str(tmp_path / "w.safetensors")
    (tmp_path / "dir" / "worldserve.json").write_text(json.dumps(meta))
    assert same_weights(load_world(tmp_path / "dir").decoder.model, world.decoder.model)


def test_with_decoder_swaps_in_taehv_weights_from_a_local_file(tmp_path: Path):
    world_cfg, dit, _ = tiny_random_configs()  # a tiny DiT on Wan-shaped latents: 16 ch, 4 frames each
    dit = replace(dit, in_channels=16, out_channels=16, action=replace(dit.action, frames_per_latent=4))
    small = TAEHVConfig(enc_width=8, dec_widths=(8, 8, 8, 8), blocks=1)
    world = build_world(replace(world_cfg, id="wan16"), dit, small, seed=0, decoder="taehv")
    torch.manual_seed(5)
    weights = TAEHV(TAEHVConfig()).state_dict()  # taew2_1's shapes
    path = tmp_path / "taew2_1.safetensors"
    save_file(weights, str(path))
    swapped = with_decoder(world, f"taehv:{path}")
    assert swapped.transformer is world.transformer and swapped.config == world.config
    assert isinstance(swapped.decoder, TAEHVDecoder) and swapped.decoder.model.cfg == TAEHVConfig()
    own = swapped.decoder.model.state_dict()
    assert all(torch.equal(own[k], weights[k]) for k in weights)
    state = swapped.init_state(Conditioning(seed=1))
    frames, _ = swapped.decode(torch.randn(16, 2, 8, 8), state)
    assert frames.shape == (5, 64, 64, 3)
    with pytest.raises(ValueError, match="expected taehv:PATH"):
        with_decoder(world, str(path))
    with pytest.raises(ValueError, match="latent channels"):  # tiny-random's DiT takes 8 channels
        with_decoder(from_name("tiny-random"), f"taehv:{path}")


def test_importing_the_registry_imports_no_family():
    code = (
        "import sys, models.registry as r; "
        "families = ('models.tiny_world', 'models.matrix_game.loader'); "
        "assert not [m for m in sys.modules if m.startswith(families)]; "
        "r.list_models(); "
        "assert 'models.tiny_world.loader' in sys.modules and 'models.matrix_game.loader' in sys.modules"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_families_register_themselves_once():
    assert "matrix-game-2" in registered("family")
    assert {"file", "game"} <= set(registered("start_image"))
    assert "tiny_world" in registered("plugin")
    assert "fast" in registered("decoder")
    with pytest.raises(ValueError, match="already registered"):
        register("tiny-world", lambda device, dtype: None)
    with pytest.raises(ValueError, match="registry kind"):
        register("x", None, kind="part")  # type: ignore[arg-type]


def test_an_unknown_plugin_is_named(tmp_path):
    from models.registry import load_plugin

    assert load_plugin(tmp_path, None) is None
    with pytest.raises(ValueError, match="unknown plugin 'nope'"):
        load_plugin(tmp_path, {"name": "nope"})

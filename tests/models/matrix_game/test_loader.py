"""A converted Matrix-Game 2.0 world served through the Engine (the batched pool path) replays
the ORIGINAL code's rollout (tests/fixtures/golden, made by make_goldens.py) within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from models.actions import FrameAction
from models.causal_wan import CausalWan
from models.convert import matrix_game
from models.matrix_game.loader import transformer_config, world_config
from models.vae import WanStreamingVAE
from models.world import Conditioning, ConditioningError, World
from runtime import parity
from runtime.engine import Engine
from runtime.requests import ChunkCommitted, ChunkRequest
from tests.fixtures.golden import GOLDEN, load_golden

TINY_VAE = {  # random weights: decoding is not part of the parity check, only its shape matters
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 4],
    "num_res_blocks": 1,
    "temperal_downsample": [True, True],
    "latents_mean": [0.0] * 16,
    "latents_std": [1.0] * 16,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 4,
}


def golden_world(variant: str, g: dict, roll: dict) -> World:
    _w, wmeta = load_golden(f"matrix_game_{variant}_tiny")
    orig = wmeta["config"]
    state, _, _ = matrix_game.convert(GOLDEN / f"matrix_game_{variant}_tiny.safetensors", orig)
    h, w = roll["latent_hw"]
    meta = {
        "variant": variant,
        "original": orig,
        "inference": matrix_game.INFERENCE[variant] | {"clip_tokens": 5, "cond_frames": 9},
        "world": {"id": "mg", "height": 4 * h, "width": 4 * w},
    }
    transformer = CausalWan(transformer_config(meta)).eval()
    transformer.load_state_dict(state, strict=True)
    torch.manual_seed(0)
    decoder = WanStreamingVAE(AutoencoderKLWan(**TINY_VAE))
    return World(world_config(meta), transformer, decoder, conditioner=parity.GoldenConditioner(g))


@pytest.mark.parametrize("variant", ["universal", "gta_drive", "templerun"])
def test_served_world_replays_the_original_rollout(variant: str) -> None:
    golden = parity.load_golden(GOLDEN / f"matrix_game_{variant}_rollout.safetensors")
    world = golden_world(variant, golden.tensors, golden.meta["rollout"])
    sched = world.config.schedule
    assert torch.allclose(torch.tensor(sched.timesteps), golden.tensors["timesteps"], atol=1e-3)
    # runtime/parity.py: the original's noise, conditioning and actions through a real Engine
    result = parity.compare(golden, parity.replay(world, golden))
    assert not result.not_produced
    assert {"x0.c2.s0", "flow.c1.s1", "block1.c1.ctx", "latents"} <= set(result.diffs)
    name, worst = result.worst
    assert worst < 1e-4, (name, worst)


def test_actions_change_the_chunk_and_prompts_are_refused() -> None:
    g, meta = load_golden("matrix_game_universal_rollout")
    world = golden_world("universal", g, meta["rollout"])
    engine = Engine({"mg": world}, max_streams=2)
    with pytest.raises(ConditioningError) as err:
        engine.add_stream(
            "p", "mg", Conditioning(image=np.zeros((8, 8, 3), np.uint8), text=torch.zeros(5, 8))
        )
    assert err.value.field == "prompt"
    image = np.full((8, 8, 3), 99, np.uint8)
    runs = []
    for i, act in enumerate([FrameAction(keys=frozenset("w")), FrameAction(mouse=(30.0, -10.0))]):
        engine.add_stream(f"s{i}", "mg", Conditioning(seed=3, image=image))
        engine.submit(ChunkRequest(f"s{i}", engine.new_request_id(), actions=[act]))
        outs = []
        while not outs:
            outs = [o for o in engine.step() if isinstance(o, ChunkCommitted)]
        runs.append(outs[0].frames)
    assert runs[0].shape == runs[1].shape and not np.array_equal(runs[0], runs[1])

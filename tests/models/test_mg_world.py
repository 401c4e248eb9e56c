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
from models.mg_world import transformer_config, world_config
from models.vae import WanStreamingVAE
from models.world import Conditioning, ConditioningError, World
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


class GoldenConditioner:
    """Stands in for the CLIP tower + VAE encoder: the original's conditioning from the fixture."""

    def __init__(self, g: dict) -> None:
        self.g = g

    def __call__(self, image: np.ndarray, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.g["cond_concat"][0], self.g["visual_context"][0]


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
    return World(world_config(meta), transformer, decoder, conditioner=GoldenConditioner(g))


def protocol_actions(world: World, g: dict) -> list[FrameAction]:
    """The fixture's raw (video-rate) actions as protocol frames: keys by column, mouse
    [pitch, yaw] back to (dx, dy) = (yaw, -pitch) / scale."""
    keys = world.action_space.keys
    scale = matrix_game.MOUSE_SCALE
    out = []
    for r in range(g["keyboard"].shape[1]):
        held = frozenset(k for k, v in zip(keys, g["keyboard"][0, r].tolist(), strict=True) if v > 0.5)
        mouse = (0.0, 0.0)
        if "mouse" in g:
            pitch, yaw = g["mouse"][0, r].tolist()
            mouse = (yaw / scale, -pitch / scale)
        out.append(FrameAction(keys=held, mouse=mouse))
    return out


@pytest.mark.parametrize("variant", ["universal", "gta_drive", "templerun"])
def test_served_world_replays_the_original_rollout(variant: str) -> None:
    g, meta = load_golden(f"matrix_game_{variant}_rollout")
    roll = meta["rollout"]
    world = golden_world(variant, g, roll)
    n = roll["num_frame_per_block"]
    sched = world.config.schedule
    assert torch.allclose(torch.tensor(sched.timesteps), g["timesteps"], atol=1e-3)

    def noise_batch(keys, n_frames):  # the original's noise and re-noise draws, by (chunk, step)
        out = []
        for _seed, chunk, step in keys:
            c = chunk - 1
            out.append(
                g["noise"][0, :, c * n : (c + 1) * n] if step == 0 else g[f"renoise.c{c}.s{step - 1}"][0]
            )
        return torch.stack(out)

    x0s: list[torch.Tensor] = []
    denoise = world.denoise

    def recording_denoise(x_t, t, index, actions):  # every step's x0, as the runner computes it
        pred = denoise(x_t, t, index, actions)
        x0s.append(sched.to_x0(pred, x_t, sched.sigmas[len(x0s) % len(sched.sigmas)])[0])
        return pred

    world.noise_batch = noise_batch  # type: ignore[method-assign]
    world.denoise = recording_denoise  # type: ignore[method-assign]
    engine = Engine({"mg": world}, max_streams=2)
    engine.add_stream("s", "mg", Conditioning(seed=1, image=np.zeros((8, 8, 3), np.uint8)))
    frames = protocol_actions(world, g)
    bounds = [0, 9, 21, 33]  # chunk 1: 1 + 4*2 video frames, then 12 per chunk
    for c in range(roll["chunks"]):
        engine.submit(ChunkRequest("s", engine.new_request_id(), actions=frames[bounds[c] : bounds[c + 1]]))
        outs = []
        while not outs:
            outs = [o for o in engine.step() if isinstance(o, ChunkCommitted)]
    steps = len(sched.steps)
    worst = 0.0
    for c in range(roll["chunks"]):
        for s in range(steps):
            worst = max(worst, (x0s[c * steps + s] - g[f"x0.c{c}.s{s}"][0]).abs().max().item())
    final = torch.cat([x0s[c * steps + steps - 1] for c in range(roll["chunks"])], dim=1)
    assert worst < 1e-4, worst
    assert (final - g["latents"][0]).abs().max().item() < 1e-4


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

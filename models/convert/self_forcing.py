"""Self-Forcing (guandeh17/Self-Forcing; causal Wan2.1-T2V-1.3B) -> our causal Wan.

The released `self_forcing_dmd.pt` holds `generator` and `generator_ema` state dicts whose keys
are the original Wan names under `model.` (the original loads them strictly into its
`WanDiffusionWrapper`); the documented inference uses `generator_ema`. The transformer maps key
for key onto `models.causal_wan.CausalWan` (= diffusers `WanTransformer3DModel` names).
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.causal_wan import CausalWan, CausalWanConfig
from models.convert import wan_dit
from models.convert.keymap import ConversionError, KeyMap, Shape, apply, check, module_shapes
from models.convert.sources import read_state

PREFIX = "model."
PICK = ("generator_ema", "generator")  # the documented command loads generator_ema
# Wan2.1-T2V-1.3B as Self-Forcing builds it (CausalWanModel kwargs; wan/configs/wan_t2v_1_3B.py)
PUBLISHED = {
    "model_type": "t2v",
    "patch_size": [1, 2, 2],
    "text_len": 512,
    "in_dim": 16,
    "dim": 1536,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "text_dim": 4096,
    "out_dim": 16,
    "num_heads": 12,
    "num_layers": 30,
    "qk_norm": True,
    "cross_attn_norm": True,
    "eps": 1e-6,
    "local_attn_size": -1,
    "sink_size": 0,
}
TRAINED_FRAMES = 21  # latent frames of the released model's training window (its KV cache size)
# configs/self_forcing_dmd.yaml + inference defaults
INFERENCE = {
    "denoising_step_list": [1000, 750, 500, 250],
    "warp_denoising_step": True,
    "timestep_shift": 5.0,
    "warped_timesteps": [1000.0, 937.5, 833.3333, 625.0],
    "num_frame_per_block": 3,
    "context_noise": 0,
    "context_timestep": 0,
    "height": 480,
    "width": 832,
    "latent_hw": [60, 104],
    "tokens_per_frame": 1560,
    "fps": 16,
    "text": {"encoder": "umt5-xxl", "tokens": 512, "dim": 4096, "padding": "zero rows, attended (no mask)"},
    "rope_frame_index": "absolute latent frame, never re-based after eviction",
}


def model_config(original: dict) -> CausalWanConfig:
    """Our causal Wan config for original CausalWanModel kwargs (window: local_attn_size, sink)."""
    o = PUBLISHED | original
    if o.get("model_type", "t2v") != "t2v":
        raise ConversionError(f"Self-Forcing checkpoints are text-to-video; config says {o['model_type']!r}")
    if list(o["patch_size"]) != [1, 2, 2]:
        raise ConversionError(
            f"patch_size {o['patch_size']} is not supported (causal caching needs (1, 2, 2))"
        )
    span = TRAINED_FRAMES if o["local_attn_size"] == -1 else int(o["local_attn_size"])
    sink = int(o["sink_size"])
    if sink >= span:
        raise ConversionError(f"sink_size {sink} must be below the attention span {span}")
    return CausalWanConfig(
        num_attention_heads=o["num_heads"],
        attention_head_dim=o["dim"] // o["num_heads"],
        in_channels=o["in_dim"],
        out_channels=o["out_dim"],
        text_dim=o["text_dim"],
        freq_dim=o["freq_dim"],
        ffn_dim=o["ffn_dim"],
        num_layers=o["num_layers"],
        cross_attn_norm=o["cross_attn_norm"],
        eps=o["eps"],
        chunk_frames=INFERENCE["num_frame_per_block"],
        window_frames=span - sink,  # the original's span counts the sink frames
        sink_frames=sink,
        null_text_len=o["text_len"],
    )


def key_map(original: dict) -> KeyMap:
    """Original (prefixed) -> our names for a Self-Forcing generator."""
    o = PUBLISHED | original
    return wan_dit.prefixed(
        wan_dit.dit_map(o["num_layers"], text=True, image=False, cross_attn_norm=o["cross_attn_norm"]), PREFIX
    )


def target_shapes(cfg: CausalWanConfig) -> dict[str, Shape]:
    """Key -> shape of our causal Wan for `cfg`, built on the meta device."""
    with torch.device("meta"):
        return module_shapes(CausalWan(cfg))


def check_shapes(source: dict[str, Shape], original: dict | None = None) -> None:
    """Check a key -> shape table (no tensors) against our model; raises ConversionError."""
    original = original or {}
    check(source, key_map(original), target_shapes(model_config(original)), "self-forcing")


def convert(path: Path, original: dict | None = None) -> tuple[dict[str, torch.Tensor], CausalWanConfig]:
    """Our transformer state dict and config from a Self-Forcing checkpoint file."""
    original = original or {}
    state = read_state(path, PICK)
    cfg = model_config(original)
    return apply(state, key_map(original), target_shapes(cfg), f"self-forcing {path.name}"), cfg

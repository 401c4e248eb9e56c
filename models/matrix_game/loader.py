"""Serving a converted Matrix-Game 2.0 directory (`worldserve convert --from matrix-game-2`).

The directory (models/convert/output.py) holds the transformer in diffusers Wan I2V names plus
`blocks.N.action_model.*`, the Wan VAE and the CLIP visual tower; its worldserve.json records the
original config and every inference setting. This module turns that into a `World`: a `CausalWan`
with the Matrix-Game action module (`matrix_game.serving_config`), the Wan VAE as decoder, and an
`ImageConditioner` that turns each session's start image into its conditioning. Importing it
registers the family with `models.registry` (listed in `models.families`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from models.causal_wan import CausalWan, CausalWanConfig
from models.convert import matrix_game
from models.convert.output import served_world
from models.matrix_game.clip_vision import CLIPVision, CLIPVisionConfig
from models.matrix_game.image import ImageConditioner
from models.registry import load_state, register, start_image_fn
from models.vae import WanStreamingVAE
from models.world import World, WorldConfig

WEIGHTS = "diffusion_pytorch_model.safetensors"
CLIP_WEIGHTS = "model.safetensors"
FAMILY = "matrix-game-2"  # worldserve.json "family" of the directories this module loads


def world_config(meta: dict) -> WorldConfig:
    """The serving settings of a converted directory: its inference record, then any "world"
    entries of worldserve.json on top (e.g. a smaller frame size for a tiny test world)."""
    inf = meta["inference"]
    variant = meta.get("variant", "custom")
    base = served_world(
        inf,
        f"matrix-game-2-{variant}",
        True,
        f"Matrix-Game 2.0 ({variant}), converted from the original checkpoint",
    )
    return WorldConfig.from_dict(base | meta.get("world", {}))


def transformer_config(meta: dict) -> CausalWanConfig:
    """Our transformer config for a converted directory's worldserve.json."""
    inf = meta["inference"]
    return matrix_game.serving_config(
        meta["original"], inf, cond_frames=inf.get("cond_frames", matrix_game.COND_FRAMES)
    )


def build_world(
    meta: dict,
    transformer: CausalWan,
    vae: AutoencoderKLWan,
    clip: CLIPVision,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    start_image: Callable[[int], np.ndarray] | None = None,
) -> World:
    """A Matrix-Game world from loaded modules (moved to `device` / `dtype` here); sessions that
    send no `open.image` start from `start_image(seed)` (none: they must send one)."""
    vae = vae.to(device=device, dtype=dtype)
    decoder = WanStreamingVAE(vae)
    conditioner = ImageConditioner(decoder, clip.to(device=device, dtype=dtype), transformer.cfg.cond_frames)
    return World(
        world_config(meta),
        transformer.to(device=device, dtype=dtype),
        decoder,
        device=device,
        dtype=dtype,
        conditioner=conditioner,
        start_image=start_image,
    )


def load_matrix_game(
    root: Path, meta: dict, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> World:
    """Load a converted Matrix-Game 2.0 directory (every weight strictly, see `load_state`)."""
    transformer = CausalWan(transformer_config(meta))
    load_state(transformer, root / "transformer" / WEIGHTS)
    vae_cfg = json.loads((root / "vae" / "config.json").read_text())
    vae = AutoencoderKLWan(**{k: v for k, v in vae_cfg.items() if not k.startswith("_")})
    load_state(vae, root / "vae" / WEIGHTS)
    clip = CLIPVision(CLIPVisionConfig(**json.loads((root / "clip" / "config.json").read_text())))
    load_state(clip, root / "clip" / CLIP_WEIGHTS)
    if clip.cfg.dim != transformer.cfg.image_dim:
        raise ValueError(
            f"{root}: CLIP width {clip.cfg.dim}, the transformer takes {transformer.cfg.image_dim}"
        )
    start = start_image_fn(meta.get("start_image"), root)
    return build_world(meta, transformer, vae, clip, device, dtype, start)


register(FAMILY, load_matrix_game, kind="family")

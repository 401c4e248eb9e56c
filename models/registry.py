"""Named worlds and the loader for local model directories (never a hub).

A model directory has diffusers' layout plus one file of serving settings::

    DIR/worldserve.json                      {"world": WorldConfig, "transformer": CausalWanConfig}
    DIR/transformer/diffusion_pytorch_model.safetensors
    DIR/vae/config.json                      AutoencoderKLWan config
    DIR/vae/diffusion_pytorch_model.safetensors

`transformer/config.json` is accepted too when worldserve.json has no "transformer" entry,
so a plain diffusers Wan checkpoint loads with only a small worldserve.json beside it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file

from models.causal_wan import ActionConfig, CausalWan, CausalWanConfig
from models.sampler import FlowSchedule
from models.vae import WanStreamingVAE
from models.world import World, WorldConfig

WEIGHTS = "diffusion_pytorch_model.safetensors"
# diffusers' own loader drops these keys (Wan I2V leftovers); so do we.
IGNORED_KEYS = ("norm_added_q",)


class UnknownModelError(KeyError):
    """No model of that name (the protocol's `not_found`)."""


def tiny_random_configs() -> tuple[WorldConfig, CausalWanConfig, dict]:
    """`tiny-random`: seeded random weights, small enough for CPU tests (64x64, 4 frames a chunk)."""
    world = WorldConfig(
        id="tiny-random",
        fps=15.0,
        width=64,
        height=64,
        schedule=FlowSchedule(steps=(1000, 750, 500, 250), shift=3.0),
        description="random weights (noise video); for tests and smoke runs",
    )
    dit = CausalWanConfig(
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=8,
        out_channels=8,
        text_dim=16,
        freq_dim=32,
        ffn_dim=128,
        num_layers=4,
        chunk_frames=2,
        window_frames=6,
        sink_frames=1,
        action=ActionConfig(
            keys=("w", "a", "s", "d", "space"),
            mouse=True,
            vector_dim=2,
            frames_per_latent=2,
            blocks=2,
            key_dim=32,
            motion_dim=32,
            heads=2,
        ),
    )
    vae = {
        "base_dim": 8,
        "z_dim": 8,
        "dim_mult": [1, 2, 4],
        "num_res_blocks": 1,
        "temperal_downsample": [False, True],
        "latents_mean": [0.0] * 8,
        "latents_std": [1.0] * 8,
        "scale_factor_temporal": 2,
        "scale_factor_spatial": 4,
    }
    return world, dit, vae


def build_world(
    world: WorldConfig,
    dit: CausalWanConfig,
    vae: dict,
    seed: int | None = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> World:
    """Construct a world from configs; weights random from `seed` (None: leave torch's RNG alone)."""
    if seed is not None:
        torch.manual_seed(seed)
    transformer = CausalWan(dit).to(device=device, dtype=dtype)
    autoencoder = AutoencoderKLWan(**vae).to(device=device)
    if dtype != torch.float32:
        autoencoder = autoencoder.to(dtype=dtype)
    return World(world, transformer, WanStreamingVAE(autoencoder), device=device, dtype=dtype)


def load_state(module: torch.nn.Module, path: Path) -> None:
    """Load safetensors into `module` through an explicit key map: every key must exist on both
    sides (besides IGNORED_KEYS) with the same shape, or this raises with the full list."""
    state = {k: v for k, v in load_file(str(path)).items() if not any(i in k for i in IGNORED_KEYS)}
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"{path}: missing {missing[:8]}, unexpected {unexpected[:8]}, mismatched {mismatched[:8]}"
        )
    module.load_state_dict(state, strict=True)


def save_world(world: World, path: str | Path, vae_config: dict) -> None:
    """Write a world as a model directory (see the module docstring)."""
    root = Path(path)
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    (root / "vae").mkdir(parents=True, exist_ok=True)
    meta = {"world": world.config.to_dict(), "transformer": world.transformer.cfg.to_dict()}
    (root / "worldserve.json").write_text(json.dumps(meta, indent=2))
    (root / "vae" / "config.json").write_text(json.dumps(vae_config, indent=2))
    save_file(
        {k: v.contiguous() for k, v in world.transformer.state_dict().items()},
        str(root / "transformer" / WEIGHTS),
    )
    vae = world.decoder.vae  # type: ignore[attr-defined]
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(root / "vae" / WEIGHTS))


def load_world(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> World:
    """Load a model directory from local disk."""
    root = Path(path)
    if not (root / "worldserve.json").is_file():
        raise FileNotFoundError(f"{root} is not a model directory (no worldserve.json)")
    meta = json.loads((root / "worldserve.json").read_text())
    tcfg = meta.get("transformer")
    if tcfg is None:
        tcfg = json.loads((root / "transformer" / "config.json").read_text()) | meta.get("rollout", {})
    dit = CausalWanConfig.from_dict(tcfg)
    vae_cfg = json.loads((root / "vae" / "config.json").read_text())
    vae_cfg = {k: v for k, v in vae_cfg.items() if not k.startswith("_")}
    world = build_world(WorldConfig.from_dict(meta["world"]), dit, vae_cfg, seed=None)
    load_state(world.transformer, root / "transformer" / WEIGHTS)
    load_state(world.decoder.vae, root / "vae" / WEIGHTS)  # type: ignore[attr-defined]
    if torch.device(device) == torch.device("cpu") and dtype == torch.float32:
        return world
    return World(
        world.config,
        world.transformer.to(device=device, dtype=dtype),
        WanStreamingVAE(world.decoder.vae.to(device=device, dtype=dtype)),  # type: ignore[attr-defined]
        device=device,
        dtype=dtype,
    )


def _tiny_random(device: torch.device | str, dtype: torch.dtype) -> World:
    return build_world(*tiny_random_configs(), seed=0, device=device, dtype=dtype)


# name -> builder(device, dtype). Directory-backed entries are added by the packages that ship them.
REGISTRY: dict[str, Callable[[torch.device | str, torch.dtype], World]] = {
    "tiny-random": _tiny_random,
}
DEFAULT_MODEL = "tiny-random"


def from_name(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> World:
    """Load a registered world by name, or a model directory by path."""
    if name in REGISTRY:
        return REGISTRY[name](device, dtype)
    if Path(name).is_dir():
        return load_world(name, device, dtype)
    raise UnknownModelError(f"unknown model {name!r}; known: {sorted(REGISTRY)} or a model directory path")


def list_models() -> list[str]:
    """Registered model names."""
    return sorted(REGISTRY)

"""`Wan2.1_VAE.pth` (original Wan names) -> diffusers `AutoencoderKLWan` names.

The renames follow diffusers' `convert_wan_vae_to_diffusers`, written as rules over the original
module tree: `conv1`/`conv2` -> `quant_conv`/`post_quant_conv`; `{en,de}coder.conv1` -> `conv_in`;
`middle.{0,1,2}` -> `mid_block.{resnets.0, attentions.0, resnets.1}`; `head.{0,2}` ->
`norm_out`/`conv_out`; residual blocks' `residual.{0,2,3,6}` -> `norm1, conv1, norm2, conv2` and
`shortcut` -> `conv_shortcut`; the decoder's flat `upsamples.K` list is regrouped into
`up_blocks.L.resnets.J` / `up_blocks.L.upsamplers.0` (num_res_blocks + 1 resnets and one
upsampler per level). Every produced name is then checked against AutoencoderKLWan's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan

from models.convert.keymap import ConversionError, KeyMap, Shape, apply, check, module_shapes
from models.convert.sources import read_state

# AutoencoderKLWan defaults are Wan 2.1's VAE; the z statistics are the original wrapper's.
WAN21_VAE_CONFIG = {
    "dim": 96,  # original WanVAE_ kwargs
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}
_RESIDUAL = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2": "conv1",
    "residual.3.gamma": "norm2.gamma",
    "residual.6": "conv2",
}
_TOP = {
    "conv1": "quant_conv",
    "conv2": "post_quant_conv",
    "encoder.conv1": "encoder.conv_in",
    "decoder.conv1": "decoder.conv_in",
    "encoder.head.0": "encoder.norm_out",
    "encoder.head.2": "encoder.conv_out",
    "decoder.head.0": "decoder.norm_out",
    "decoder.head.2": "decoder.conv_out",
}


def _residual(rest: str) -> str | None:
    for old, new in _RESIDUAL.items():
        if rest == old or rest.startswith(old + "."):
            return new + rest[len(old) :]
    if rest.startswith("shortcut."):
        return "conv_shortcut." + rest[len("shortcut.") :]
    return None


def rename(key: str, num_res_blocks: int = 2) -> str | None:
    """The diffusers name of one original VAE key (None: not a key this map knows)."""
    for old, new in _TOP.items():
        if key.startswith(old + "."):
            return new + key[len(old) :]
    parts = key.split(".")
    if len(parts) < 4:
        return None
    side, group, idx, rest = (
        parts[0],
        parts[1],
        int(parts[2]) if parts[2].isdigit() else -1,
        ".".join(parts[3:]),
    )
    if side not in ("encoder", "decoder") or idx < 0:
        return None
    if group == "middle":
        if idx == 1:
            return f"{side}.mid_block.attentions.0.{rest}"
        res = _residual(rest)
        return f"{side}.mid_block.resnets.{idx // 2}.{res}" if res and idx in (0, 2) else None
    if group == "downsamples" and side == "encoder":
        res = _residual(rest)
        return f"encoder.down_blocks.{idx}.{res or rest}"
    if group == "upsamples" and side == "decoder":
        per_level = num_res_blocks + 2  # resnets then one upsampler
        level, j = divmod(idx, per_level)
        if j == per_level - 1:
            return f"decoder.up_blocks.{level}.upsamplers.0.{rest}"
        res = _residual(rest)
        return f"decoder.up_blocks.{level}.resnets.{j}.{res}" if res else None
    return None


def key_map(keys: list[str], num_res_blocks: int = 2) -> KeyMap:
    """Explicit map for the keys of an original VAE checkpoint (unknown keys stay unmapped)."""
    out = {}
    for k in keys:
        new = rename(k, num_res_blocks)
        if new is not None:
            out[k] = new
    return KeyMap(out)


def target_shapes(config: dict | None = None) -> dict[str, Shape]:
    """Key -> shape of AutoencoderKLWan for `config` (default Wan 2.1), on the meta device."""
    cfg = diffusers_config(config)
    with torch.device("meta"):
        return module_shapes(AutoencoderKLWan(**cfg))


def diffusers_config(config: dict | None = None) -> dict:
    """AutoencoderKLWan kwargs for the original WanVAE_ kwargs (default Wan 2.1)."""
    c = WAN21_VAE_CONFIG | (config or {})
    if c["attn_scales"]:
        raise ConversionError(f"VAE attn_scales {c['attn_scales']} are not supported by AutoencoderKLWan")
    return {
        "base_dim": c["dim"],
        "z_dim": c["z_dim"],
        "dim_mult": list(c["dim_mult"]),
        "num_res_blocks": c["num_res_blocks"],
        "temperal_downsample": list(c["temperal_downsample"]),
        # what the streaming decoder reads (diffusers' defaults, 8 and 4, fit Wan 2.1 only)
        "scale_factor_spatial": 2 ** (len(c["dim_mult"]) - 1),
        "scale_factor_temporal": 2 ** sum(bool(t) for t in c["temperal_downsample"]),
    }


def check_shapes(source: dict[str, Shape], config: dict | None = None) -> None:
    """Check an original key -> shape table against AutoencoderKLWan; raises ConversionError."""
    c = WAN21_VAE_CONFIG | (config or {})
    check(source, key_map(list(source), c["num_res_blocks"]), target_shapes(config), "wan vae")


def convert(path: Path, config: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(AutoencoderKLWan state dict, its config) from an original `Wan2.1_VAE.pth`."""
    state = read_state(path)
    c = WAN21_VAE_CONFIG | (config or {})
    out = apply(
        state, key_map(list(state), c["num_res_blocks"]), target_shapes(config), f"wan vae {path.name}"
    )
    return out, diffusers_config(config)

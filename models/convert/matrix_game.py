"""Matrix-Game 2.0 (SkyworkAI/Matrix-Game, Matrix-Game-2) -> diffusers Wan I2V names + action modules.

The released `base_distilled_model/base_distill.safetensors` (and the GTA / Temple Run ones) hold
the original Wan names under `model.` (the original loads them strictly into its wrapper). The DiT
maps onto diffusers `WanTransformer3DModel` names with `image_dim=1280` (the image embedder is the
original `img_emb`; there is no text embedder: cross-attention reads only the 257 projected CLIP
tokens). The action modules of blocks 0-14 keep their original names under
`blocks.N.action_model.*` and load into `models.matrix_game.action.MGActionModule`; the four q/k RMSNorm
weights the original stores but never multiplies are dropped.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from models.causal_wan import ActionConfig, CausalWanConfig
from models.convert import wan_dit
from models.convert.keymap import ConversionError, KeyMap, Shape, apply, check, module_shapes
from models.convert.sources import read_state
from models.matrix_game.action import MGActionConfig, MGActionModule

PREFIX = "model."
UNUSED_NORMS = {
    "img_attn_q_norm": "enable_mouse",
    "img_attn_k_norm": "enable_mouse",
    "key_attn_q_norm": "enable_keyboard",
    "key_attn_k_norm": "enable_keyboard",
}


def _action(keyboard: int, mouse: bool) -> dict:
    cfg = {
        "blocks": list(range(15)),
        "enable_keyboard": True,
        "enable_mouse": mouse,
        "heads_num": 16,
        "hidden_size": 128,
        "img_hidden_size": 1536,
        "keyboard_dim_in": keyboard,
        "keyboard_hidden_dim": 1024,
        "patch_size": [1, 2, 2],
        "qk_norm": True,
        "qkv_bias": False,
        "rope_dim_list": [8, 28, 28],
        "rope_theta": 256,
        "vae_time_compression_ratio": 4,
        "windows_size": 3,
    }
    if mouse:
        cfg |= {"mouse_dim_in": 2, "mouse_hidden_dim": 1024, "mouse_qk_dim_list": [8, 28, 28]}
    return cfg


_DIT = {
    "model_type": "i2v",
    "dim": 1536,
    "eps": 1e-6,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "in_dim": 36,
    "num_heads": 12,
    "num_layers": 30,
    "out_dim": 16,
    "sink_size": 0,
    "text_len": 512,
}
# configs/distilled_model/{universal,gta_drive,templerun}/config.json
PUBLISHED = {
    "universal": _DIT | {"local_attn_size": 6, "action_config": _action(4, True)},
    "gta_drive": _DIT | {"local_attn_size": 4, "action_config": _action(2, True)},
    "templerun": _DIT | {"local_attn_size": 6, "action_config": _action(7, False)},
}
# configs/inference_yaml/inference_*.yaml and the pipeline's fixed settings
_COMMON = {
    "warp_denoising_step": True,
    "timestep_shift": 5.0,
    "num_frame_per_block": 3,
    "context_noise": 0,
    "context_timestep": 0,
    "height": 352,
    "width": 640,
    "latent_hw": [44, 80],
    "tokens_per_frame": 880,
    "fps": 12,  # the original's video writer
    "clip_tokens": 257,
    "cond_channels": {"mask": 4, "image_latents": 16},
    "image_preprocess": "center-crop to 352:640 aspect, resize to 352x640, scale to [-1, 1]",
    "rope_frame_index": "absolute latent frame, never re-based after eviction",
    "action_window": "latent frame f sees raw action frames 4f-12..4f-1, front-padded with frame 0",
}
INFERENCE = {
    "universal": _COMMON
    | {"denoising_step_list": [1000, 666, 333], "warped_timesteps": [1000.0, 908.8427, 713.9794]},
    "gta_drive": _COMMON
    | {"denoising_step_list": [1000, 666, 333], "warped_timesteps": [1000.0, 908.8427, 713.9794]},
    "templerun": _COMMON
    | {"denoising_step_list": [1000, 750, 500, 250], "warped_timesteps": [1000.0, 937.5, 833.3333, 625.0]},
}
VAE_SPATIAL = 8  # pixels per latent cell along each side (the Wan VAE)
FRAME_MULTIPLE = 16  # pixels per token along each side: the VAE's 8 times the DiT's 2x2 patch
MOUSE = {"columns": ["pitch", "yaw"], "from_protocol": "pitch = -dy * scale, yaw = dx * scale", "scale": 0.01}
# Action columns in the original's order, with the keys its own interactive demo binds to them.
ACTION_SPACE = {
    "universal": {
        "keyboard": [["forward", "w"], ["back", "s"], ["left", "a"], ["right", "d"]],
        "mouse": MOUSE,
    },
    "gta_drive": {
        "keyboard": [["forward", "w"], ["back", "s"]],
        "mouse": MOUSE | {"note": "the original demo steers with a/d as yaw -0.1/+0.1"},
    },
    "templerun": {
        "keyboard": [
            ["nomove", "q"],
            ["jump", "w"],
            ["slide", "s"],
            ["turnleft", "z"],
            ["turnright", "c"],
            ["leftside", "a"],
            ["rightside", "d"],
        ],
        "mouse": None,
    },
}


def detect_variant(state: dict[str, torch.Tensor | Shape]) -> str:
    """universal / gta_drive / templerun from the keyboard width and whether a mouse MLP exists."""
    from models.convert.keymap import shape_of

    key = PREFIX + "blocks.0.action_model.keyboard_embed.0.weight"
    if key not in state:
        raise ConversionError(f"not a Matrix-Game 2.0 checkpoint: no {key}")
    width = shape_of(state[key])[1]
    mouse = PREFIX + "blocks.0.action_model.mouse_mlp.0.weight" in state
    for name, cfg in PUBLISHED.items():
        a = cfg["action_config"]
        if a["keyboard_dim_in"] == width and a["enable_mouse"] == mouse:
            return name
    raise ConversionError(
        f"keyboard width {width} with mouse={mouse} matches no published variant; pass --config"
    )


def action_config(original: dict) -> MGActionConfig:
    """The action-module config of original CausalWanModel kwargs."""
    return MGActionConfig.from_original(original["action_config"], original["local_attn_size"])


def dit_diffusers_config(original: dict) -> dict:
    """diffusers `WanTransformer3DModel` kwargs for original kwargs (image embedder, no text)."""
    return {
        "patch_size": [1, 2, 2],
        "num_attention_heads": original["num_heads"],
        "attention_head_dim": original["dim"] // original["num_heads"],
        "in_channels": original["in_dim"],
        "out_channels": original["out_dim"],
        "text_dim": 4096,  # the text embedder is dropped below; its width does not matter
        "freq_dim": original["freq_dim"],
        "ffn_dim": original["ffn_dim"],
        "num_layers": original["num_layers"],
        "cross_attn_norm": True,
        "eps": original["eps"],
        "image_dim": 1280,
    }


def target_shapes(original: dict) -> dict[str, Shape]:
    """Key -> shape of the converted checkpoint, built on the meta device."""
    with torch.device("meta"):
        dit = WanTransformer3DModel(**dit_diffusers_config(original))
        action = MGActionModule(action_config(original))
    out = {
        k: v for k, v in module_shapes(dit).items() if not k.startswith("condition_embedder.text_embedder.")
    }
    for i in original["action_config"]["blocks"]:
        out |= {f"blocks.{i}.action_model.{k}": v for k, v in module_shapes(action).items()}
    return out


def key_map(original: dict) -> KeyMap:
    """Original (prefixed) -> converted names."""
    keymap = wan_dit.dit_map(original["num_layers"], text=False, image=True)
    a = original["action_config"]
    with torch.device("meta"):
        names = list(MGActionModule(action_config(original)).state_dict())
    for i in a["blocks"]:
        keymap.rename |= {f"blocks.{i}.action_model.{n}": f"blocks.{i}.action_model.{n}" for n in names}
        for norm, switch in UNUSED_NORMS.items():
            if a.get(switch, True) and a.get("qk_norm", True):
                keymap.ignored[f"blocks.{i}.action_model.{norm}.weight"] = (
                    "RMSNorm weight the original never applies"
                )
    return wan_dit.prefixed(keymap, PREFIX)


def resolve(state: dict[str, torch.Tensor | Shape], original: dict | None) -> tuple[str, dict]:
    """(variant name, original config): the given config, or the published one the weights match.
    A given config names its variant by "mode"; the published configs carry none, so without it
    the variant (and with it the inference schedule) comes from the weights' action shapes."""
    if original is not None:
        if "mode" in original:
            return original["mode"], original
        try:
            return detect_variant(state), original
        except ConversionError:
            return "custom", original
    variant = detect_variant(state)
    return variant, PUBLISHED[variant]


def check_shapes(source: dict[str, Shape], original: dict | None = None) -> str:
    """Check a key -> shape table (no tensors); returns the variant. Raises ConversionError."""
    variant, cfg = resolve(source, original)
    check(source, key_map(cfg), target_shapes(cfg), f"matrix-game-2 ({variant})")
    return variant


def convert(path: Path, original: dict | None = None) -> tuple[dict[str, torch.Tensor], str, dict]:
    """(converted state dict, variant, original config) from a Matrix-Game 2.0 safetensors file."""
    frame_size(original)  # a bad --config size fails before the checkpoint is read (minutes at full size)
    state = read_state(path)
    variant, cfg = resolve(state, original)
    out = apply(state, key_map(cfg), target_shapes(cfg), f"matrix-game-2 {path.name} ({variant})")
    return out, variant, cfg


def frame_size(original: dict | None) -> tuple[int, int]:
    """(height, width) of the served frames: the published 352x640, or `height` / `width` of a
    --config (e.g. a small test world). Raises ConversionError naming the field when a side is
    not a positive multiple of `FRAME_MULTIPLE`."""
    size = {"height": _COMMON["height"], "width": _COMMON["width"]}
    for key in size:
        value = (original or {}).get(key)
        if value is None:
            continue
        if type(value) is not int or value <= 0 or value % FRAME_MULTIPLE:
            raise ConversionError(
                f"--config {key} {value!r}: a frame side must be a positive multiple of {FRAME_MULTIPLE} "
                f"(the published frame is {_COMMON['height']}x{_COMMON['width']})"
            )
        size[key] = value
    return size["height"], size["width"]


def inference_settings(variant: str, original: dict) -> dict:
    """The inference record of a converted directory: the variant's published settings (a custom
    config gets the universal ones), its attention window, and its frame size (`frame_size`)."""
    inf = dict(INFERENCE.get(variant, INFERENCE["universal"]))
    inf |= {"local_attn_size": original["local_attn_size"], "sink_size": original.get("sink_size", 0)}
    h, w = frame_size(original)
    return inf | {
        "height": h,
        "width": w,
        "latent_hw": [h // VAE_SPATIAL, w // VAE_SPATIAL],
        "tokens_per_frame": (h // FRAME_MULTIPLE) * (w // FRAME_MULTIPLE),
        "image_preprocess": f"center-crop to {h}:{w} aspect, resize to {h}x{w}, scale to [-1, 1]",
    }


MOUSE_SCALE = MOUSE["scale"]
COND_FRAMES = 30  # conditioning frames kept: the Wan encoder's receptive field (benchmarks/mg_cond_frames.py)


def serving_config(original: dict, inference: dict, cond_frames: int = COND_FRAMES) -> CausalWanConfig:
    """Our `CausalWanConfig` for original Matrix-Game kwargs and the recorded inference settings:
    I2V (in_dim 36, cross-attention to `clip_tokens` image tokens of width 1280), the original's
    action module in its blocks under kind "matrix-game" with the protocol keys of the variant's
    action-space table, window = `local_attn_size` (the chunk included), sink 0."""
    act = action_config(original)
    table = ACTION_SPACE.get(original.get("mode", ""))
    if table is None:  # a custom config: name the columns by the published table of that width
        table = next(
            (t for t in ACTION_SPACE.values() if len(t["keyboard"]) == act.keyboard_dim_in),
            {"keyboard": [[f"key{i}", f"k{i}"] for i in range(act.keyboard_dim_in)]},
        )
    if max(act.blocks) + 1 != len(act.blocks):
        raise ValueError(f"action blocks {act.blocks} must be the leading blocks 0..N-1")
    dit = dit_diffusers_config(original)
    return CausalWanConfig(
        patch_size=tuple(dit["patch_size"]),
        num_attention_heads=dit["num_attention_heads"],
        attention_head_dim=dit["attention_head_dim"],
        in_channels=dit["in_channels"],
        out_channels=dit["out_channels"],
        freq_dim=dit["freq_dim"],
        ffn_dim=dit["ffn_dim"],
        num_layers=dit["num_layers"],
        eps=dit["eps"],
        chunk_frames=inference["num_frame_per_block"],
        window_frames=original["local_attn_size"],
        sink_frames=original.get("sink_size", 0),
        null_text_len=inference["clip_tokens"],
        image_dim=dit["image_dim"],
        cond_frames=cond_frames,
        action=ActionConfig(
            kind="matrix-game",
            matrix_game=act.to_dict(),
            keys=tuple(k for _, k in table["keyboard"]),
            mouse=act.enable_mouse,
            frames_per_latent=act.vae_time_compression_ratio,
            blocks=len(act.blocks),
            heads=act.heads_num,
            motion_dim=act.mouse_hidden_dim,
            mouse_scale=MOUSE_SCALE,
        ),
    )

"""`worldserve convert`: original checkpoint files -> one model directory, all or nothing.

Layout written (see docs/MODELS.md)::

    DIR/worldserve.json                        family, variant, "requires", original config,
                                               every inference setting, the action-space table
                                               (+ "world"/"transformer"/"decoder" for Self-Forcing)
    DIR/transformer/config.json                diffusers WanTransformer3DModel config
    DIR/transformer/diffusion_pytorch_model.safetensors
    DIR/vae/config.json + diffusion_pytorch_model.safetensors        (when Wan2.1_VAE.pth is given)
    DIR/clip/config.json + model.safetensors   (Matrix-Game, when the CLIP .pth is given)

Every source is read and every key map checked before anything is written; the directory is
assembled under a temporary name beside DIR and renamed into place at the end, so a failure
leaves nothing behind. "requires" lists what serving the world needs that this server cannot do
yet; `models.registry.load_world` refuses such a directory with that list.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import save_file
from tqdm import tqdm

from models.convert import clip, fastvideo, longlive, matrix_game, self_forcing, wan_vae
from models.convert.keymap import ConversionError
from models.convert.kinds import KINDS
from models.convert.sources import list_keys, read_state

WEIGHTS = "diffusion_pytorch_model.safetensors"
FORMAT = "worldserve-converted/1"


@dataclass
class Converted:
    """Everything a model directory holds, in memory, already checked."""

    family: str
    variant: str
    original: dict
    transformer: dict[str, torch.Tensor]
    transformer_config: dict
    requires: list[str]
    inference: dict
    action_space: dict | None = None
    vae: tuple[dict[str, torch.Tensor], dict] | None = None
    clip: tuple[dict[str, torch.Tensor], dict] | None = None
    serving: dict = field(default_factory=dict)  # worldserve.json sections our loader reads
    sources: list[dict] = field(default_factory=list)


def classify(path: Path) -> str:
    """What a source file is: "transformer", "lora", "vae" or "clip" (directories are transformers)."""
    if path.is_dir():
        return "transformer"
    keys = set(list_keys(path, self_forcing.PICK + longlive.LORA_PICK))
    if longlive.is_lora(list(keys)):
        return "lora"
    if any(k.startswith(("visual.", "textual.")) for k in keys):
        return "clip"
    if "encoder.conv1.weight" in keys and "decoder.conv1.weight" in keys:
        return "vae"
    return "transformer"


def convert_sources(
    kind: str, sources: list[Path], original: dict | None = None, progress: bool = False
) -> Converted:
    """Read, map and check every source (nothing is written)."""
    if kind not in KINDS:
        raise ConversionError(f"unknown --from {kind!r}; known: {', '.join(KINDS)}")
    parts: dict[str, Path] = {}
    for src in sources:
        role = classify(src)
        if role in parts:
            raise ConversionError(f"two {role} sources: {parts[role]} and {src}")
        parts[role] = src
    if "transformer" not in parts:
        raise ConversionError("no transformer checkpoint among the sources")
    if "lora" in parts and kind != "longlive":
        raise ConversionError(f"{parts['lora']}: a LoRA only belongs to --from longlive")
    bar = tqdm(total=len(parts), unit="file", desc="read + check", disable=not progress)
    if kind == "longlive":
        conv = _longlive(parts["transformer"], parts.get("lora"), original)
        bar.update(1 + ("lora" in parts))
    else:
        conv = _transformer(kind, parts["transformer"], original)
        bar.update(1)
    if "vae" in parts:
        conv.vae = wan_vae.convert(parts["vae"], (original or {}).get("vae"))  # --config "vae": sizes
        bar.update(1)
    else:
        conv.requires.append("vae")
    if "clip" in parts:
        if conv.family != "matrix-game-2":
            raise ConversionError(f"{parts['clip']}: a CLIP checkpoint only belongs to Matrix-Game worlds")
        cfg = clip.config_from_shapes(read_state(parts["clip"]))
        conv.clip = (clip.convert(parts["clip"], cfg), cfg.to_dict())
        bar.update(1)
    elif conv.family == "matrix-game-2":
        conv.requires.append("clip_vision")
    bar.close()
    conv.sources = [{"file": p.name, "role": r} for r, p in parts.items()]
    if conv.vae is not None and conv.family in ("self-forcing", "longlive"):
        conv.serving["decoder"] = {"kind": "wan"}
    return conv


def _transformer(kind: str, src: Path, original: dict | None) -> Converted:
    if kind == "fastvideo":
        state, fam, variant, cfg = fastvideo.convert(src, original)
    elif kind == "self-forcing":
        state, _ = self_forcing.convert(src, original)
        fam, variant, cfg = (
            "self-forcing",
            "t2v-1.3b" if original is None else "custom",
            self_forcing.PUBLISHED | (original or {}),
        )
    else:
        state, variant, cfg = matrix_game.convert(src, original)
        fam = "matrix-game-2"
    if fam == "self-forcing":
        return _self_forcing(state, variant, cfg)
    return _matrix_game(state, variant, cfg)


def served_world(inf: dict, world_id: str, image_start: bool, description: str) -> dict:
    """`WorldConfig` fields of a converted world from its inference record (worldserve.json)."""
    return {
        "id": world_id,
        "fps": float(inf["fps"]),
        "width": inf["width"],
        "height": inf["height"],
        "schedule": {
            "steps": inf["denoising_step_list"],
            "shift": inf["timestep_shift"],
            "num_train": 1000,
            "prediction": "flow",
        },
        "context_noise": float(inf.get("context_noise", 0)),
        "image_start": image_start,
        "description": description,
    }


def _self_forcing(state: dict, variant: str, original: dict) -> Converted:
    mcfg = self_forcing.model_config(original)
    inf = dict(self_forcing.INFERENCE)
    inf |= {"local_attn_size": original["local_attn_size"], "sink_size": original["sink_size"]}
    # frame size: the published 480x832, or `height`/`width` from --config (tiny test worlds)
    inf |= {k: int(original[k]) for k in ("height", "width") if k in original}
    world = served_world(
        inf,
        "self-forcing",
        False,
        "Self-Forcing (causal Wan2.1-T2V-1.3B), converted from the original checkpoint",
    )
    return Converted(
        family="self-forcing",
        variant=variant,
        original=original,
        transformer=state,
        transformer_config=mcfg.diffusers_config(),
        requires=["text_prompts"],
        inference=inf,
        serving={"world": world, "transformer": mcfg.to_dict()},
    )


def _longlive(base: Path, lora: Path | None, original: dict | None) -> Converted:
    """LongLive: the base generator with its LoRA merged; the world re-caches at a prompt switch."""
    if lora is None:
        raise ConversionError("--from longlive needs the LoRA (lora.pt) beside longlive_base.pt")
    state, mcfg = longlive.convert(base, lora, original)
    full = longlive.PUBLISHED | (original or {})
    inf = dict(longlive.INFERENCE)
    inf |= {"local_attn_size": full["local_attn_size"], "sink_size": full["sink_size"]}
    inf |= {"adapter": longlive.ADAPTER | (full.get("adapter") or {}), "lora": "merged at convert time"}
    inf |= {k: int(full[k]) for k in ("height", "width") if k in full}
    world = served_world(
        inf, "longlive", False, "LongLive (interactive causal Wan2.1-T2V-1.3B), base + LoRA merged"
    )
    world["prompt_switch"] = "recache"
    return Converted(
        family="longlive",
        variant="t2v-1.3b" if original is None else "custom",
        original=original or {},
        transformer=state,
        transformer_config=mcfg.diffusers_config(),
        requires=["text_prompts"],
        inference=inf,
        serving={"world": world, "transformer": mcfg.to_dict()},
    )


def _matrix_game(state: dict, variant: str, original: dict) -> Converted:
    inf = matrix_game.inference_settings(variant, original)  # frame size: published or --config
    return Converted(
        family="matrix-game-2",
        variant=variant,
        original=original,
        transformer=state,
        transformer_config=matrix_game.dit_diffusers_config(original)
        | {"action_config": original["action_config"]},
        requires=[],
        inference=inf | {"cond_frames": matrix_game.COND_FRAMES},
        action_space=matrix_game.ACTION_SPACE.get(variant),
    )


def worldserve_json(conv: Converted) -> dict:
    """The worldserve.json of a converted directory."""
    return {
        "format": FORMAT,
        "family": conv.family,
        "variant": conv.variant,
        "requires": conv.requires,
        "original": conv.original,
        "inference": conv.inference,
        "action_space": conv.action_space,
        "sources": conv.sources,
        **conv.serving,
    }


def write(conv: Converted, out: Path, progress: bool = True) -> Path:
    """Write `conv` as the model directory `out` (must not exist or be empty); all or nothing."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out} exists and is not an empty directory")
    tmp = out.parent / f".{out.name}.converting-{os.getpid()}"
    jobs: list[tuple[str, dict[str, torch.Tensor], dict]] = [
        ("transformer", conv.transformer, conv.transformer_config)
    ]
    if conv.vae is not None:
        jobs.append(("vae", conv.vae[0], _vae_config(conv.vae[1])))
    if conv.clip is not None:
        jobs.append(("clip", conv.clip[0], conv.clip[1]))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        bar = tqdm(
            total=sum(len(s) for _, s, _ in jobs),
            unit="tensor",
            desc=f"write {out.name}",
            disable=not progress,
        )
        for name, state, config in jobs:
            (tmp / name).mkdir()
            (tmp / name / "config.json").write_text(json.dumps(config, indent=2))
            fname = "model.safetensors" if name == "clip" else WEIGHTS
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / name / fname))
            bar.update(len(state))
        bar.close()
        (tmp / "worldserve.json").write_text(json.dumps(worldserve_json(conv), indent=2))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _vae_config(cfg: dict) -> dict:
    with torch.device("meta"):
        vae = AutoencoderKLWan(**cfg)
    return {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}


def load_config_file(path: Path | None) -> dict | None:
    """The --config file: the original model's config.json kwargs (keys starting with _ dropped)."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConversionError(f"--config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"--config {path}: expected a JSON object")
    return {k: v for k, v in data.items() if not k.startswith("_")}

"""The visual tower of `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` -> `CLIPVision`."""

from __future__ import annotations

from pathlib import Path

import torch

from models.convert.keymap import KeyMap, Shape, apply, check, module_shapes
from models.convert.sources import read_state
from models.matrix_game.clip_vision import CLIPVision, CLIPVisionConfig

PREFIX = "visual."
IGNORED = ("textual.", "log_scale")  # the XLM-R text tower and the logit scale: not needed


def target_shapes(cfg: CLIPVisionConfig) -> dict[str, Shape]:
    """Key -> shape of `CLIPVision(cfg)` on the meta device."""
    with torch.device("meta"):
        return module_shapes(CLIPVision(cfg))


def key_map(keys: list[str], cfg: CLIPVisionConfig) -> KeyMap:
    """`visual.X` -> `X` for every tower key; text-tower keys are ignored on purpose."""
    out = KeyMap({PREFIX + k: k for k in target_shapes(cfg)})
    out.ignored = {
        k: "text tower / logit scale: unused by image conditioning" for k in keys if k.startswith(IGNORED)
    }
    return out


def check_shapes(source: dict[str, Shape], cfg: CLIPVisionConfig | None = None) -> None:
    """Check a key -> shape table; raises ConversionError."""
    cfg = cfg or CLIPVisionConfig()
    check(source, key_map(list(source), cfg), target_shapes(cfg), "clip vision")


def convert(path: Path, cfg: CLIPVisionConfig | None = None) -> dict[str, torch.Tensor]:
    """`CLIPVision` state dict from the original CLIP checkpoint."""
    cfg = cfg or CLIPVisionConfig()
    state = read_state(path)
    return apply(state, key_map(list(state), cfg), target_shapes(cfg), f"clip {path.name}")


HEAD_WIDTH = 80  # ViT-H/14: 1280 wide, 16 heads; head count is not in the weights' shapes


def config_from_shapes(source: dict[str, Shape | torch.Tensor]) -> CLIPVisionConfig:
    """The tower's sizes read off an original checkpoint (`visual.*` shapes): width, patch, image
    size, depth, MLP ratio, head projection; heads = width / 80 (the published head width)."""
    from models.convert.keymap import ConversionError, shape_of

    missing = [k for k in ("patch_embedding.weight", "pos_embedding", "head") if PREFIX + k not in source]
    if missing or PREFIX + "transformer.0.mlp.0.weight" not in source:
        raise ConversionError(f"clip: not a CLIP visual tower (missing {missing or ['transformer.0.mlp']})")
    dim, _, patch, _ = shape_of(source[PREFIX + "patch_embedding.weight"])
    tokens = shape_of(source[PREFIX + "pos_embedding"])[1]
    layers = 1 + max(int(k.split(".")[2]) for k in source if k.startswith(PREFIX + "transformer."))
    hidden = shape_of(source[PREFIX + "transformer.0.mlp.0.weight"])[0]
    return CLIPVisionConfig(
        image_size=round((tokens - 1) ** 0.5) * patch,
        patch_size=patch,
        dim=dim,
        mlp_ratio=hidden / dim,
        num_heads=max(1, dim // HEAD_WIDTH),
        num_layers=layers,
        out_dim=shape_of(source[PREFIX + "head"])[1],
    )

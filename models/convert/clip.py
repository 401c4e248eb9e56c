"""The visual tower of `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` -> `CLIPVision`."""

from __future__ import annotations

from pathlib import Path

import torch

from models.clip_vision import CLIPVision, CLIPVisionConfig
from models.convert.keymap import KeyMap, Shape, apply, check, module_shapes
from models.convert.sources import read_state

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

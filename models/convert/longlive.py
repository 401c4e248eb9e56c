"""LongLive (NVlabs/LongLive; causal Wan2.1-T2V-1.3B, interactive) -> our causal Wan.

LongLive publishes a base generator (`longlive_base.pt`, `{"generator": ...}`, the Self-Forcing
key layout under `model.`) and a LoRA (`lora.pt`, `{"generator_lora": ...}` or a bare peft state
dict: `base_model.model.<module>.lora_A.weight` / `lora_B.weight` for every Linear of every
attention block). The documented interactive inference applies the LoRA at load with peft
(rank 256, alpha 256); here it is merged into the base at convert time,
W' = W + (alpha / rank) B A, in float32, so the served model is one plain causal Wan.

Its attention is a short local window with a frame sink (`local_attn_size` 12 frames, the 3 sink
frames included) and, at a prompt switch, a re-cache: the K/V of the frames kept in the window are
recomputed under the new prompt (`WorldConfig.prompt_switch` "recache"). Both are recorded in
worldserve.json.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.causal_wan import CausalWanConfig
from models.convert import self_forcing
from models.convert.keymap import ConversionError, apply
from models.convert.sources import read_state

PICK = ("generator",)  # configs/longlive_interactive_inference.yaml: use_ema false
LORA_PICK = ("generator_lora",)
LORA_PREFIX = "base_model.model."
# the published model kwargs: Self-Forcing's Wan2.1-T2V-1.3B with LongLive's window and sink
PUBLISHED = self_forcing.PUBLISHED | {"local_attn_size": 12, "sink_size": 3}
ADAPTER = {"rank": 256, "alpha": 256}  # configs/longlive_interactive_inference.yaml "adapter"
# configs/longlive_interactive_inference.yaml (+ the Self-Forcing inference defaults it shares)
INFERENCE = self_forcing.INFERENCE | {
    "global_sink": True,
    "prompt_switch": "recache",
    "recache_frames": "the last local_attn_size frames (all when fewer); sinks rewritten only among them",
}


def is_lora(keys: list[str]) -> bool:
    """Whether a checkpoint's keys are a peft LoRA."""
    return any(".lora_A." in k for k in keys)


def merge_lora(
    state: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], alpha: float, prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """`state` (original keys under `prefix`) with every LoRA pair merged: W + alpha / rank * B @ A.
    Every LoRA key must pair up and name a Linear weight of `state`; ConversionError otherwise."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in lora.items():
        name = key.replace(".default.", ".")
        if not name.startswith(LORA_PREFIX) or not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ConversionError(f"LoRA key {key!r} is not a peft lora_A / lora_B weight")
        module, half = name[len(LORA_PREFIX) :].rsplit(".lora_", 1)
        pairs.setdefault(module, {})[half[0]] = value
    out = dict(state)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ConversionError(f"LoRA of {module} has no lora_{'B' if 'A' in ab else 'A'}")
        target = f"{prefix}{module}.weight"
        if target not in out:
            raise ConversionError(f"LoRA targets {module}, which the base checkpoint does not have")
        a, b, w = ab["A"].float(), ab["B"].float(), out[target]
        if a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ConversionError(
                f"LoRA of {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit {tuple(w.shape)}"
            )
        out[target] = (w.float() + (alpha / a.shape[0]) * (b @ a)).to(w.dtype)
    return out


def model_config(original: dict) -> CausalWanConfig:
    """Our causal Wan config for LongLive's model kwargs (window and sink as Self-Forcing's)."""
    return self_forcing.model_config(PUBLISHED | original)


def convert(
    base: Path, lora: Path | None, original: dict | None = None
) -> tuple[dict[str, torch.Tensor], CausalWanConfig]:
    """Our transformer state dict and config from LongLive's base checkpoint, with its LoRA merged
    (`original["adapter"]["alpha"]`, default the published 256)."""
    original = PUBLISHED | (original or {})
    state = read_state(base, PICK)
    if lora is not None:
        alpha = float((original.get("adapter") or {}).get("alpha", ADAPTER["alpha"]))
        state = merge_lora(state, read_state(lora, LORA_PICK), alpha, self_forcing.PREFIX)
    cfg = model_config(original)
    return apply(
        state, self_forcing.key_map(original), self_forcing.target_shapes(cfg), f"longlive {base.name}"
    ), cfg

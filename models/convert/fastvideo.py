"""FastVideo's diffusers-layout releases (e.g. its Matrix-Game-2.0 "-Diffusers" repositories).

Their transformer weights already use diffusers `WanTransformer3DModel` names (FastVideo renames
them again at load time, which is not our concern); the Matrix-Game action modules sit under
`blocks.N.action_model.*` with the original's names. So the map is the identity onto our targets,
except `patch_embedding.proj.*` -> `patch_embedding.*` (FastVideo's own module name, which some of
its files carry) and the keys dropped on purpose: the action modules' unused q/k RMSNorm weights
and, for Matrix-Game, any text embedder (it has no text path).

Not yet checked against a real FastVideo file (none is fetched here): the names above come from
FastVideo's published parameter mapping for Matrix-Game 2.0; a file that differs fails loudly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.convert import matrix_game, self_forcing
from models.convert.keymap import ConversionError, KeyMap, Shape, apply, check
from models.convert.sources import read_state

TRANSFORMER_DIR = "transformer"


def transformer_files(src: Path) -> list[Path]:
    """The transformer safetensors of a FastVideo/diffusers directory (or the file itself)."""
    if src.is_file():
        return [src]
    for d in (src / TRANSFORMER_DIR, src):
        files = sorted(d.glob("*.safetensors"))
        if files:
            return files
    raise ConversionError(f"{src}: no transformer/*.safetensors (not a diffusers-layout model directory)")


def read(src: Path) -> dict[str, torch.Tensor]:
    """All transformer tensors of `src` (shards merged; a key in two shards is an error)."""
    state: dict[str, torch.Tensor] = {}
    for path in transformer_files(src):
        part = read_state(path)
        dup = sorted(set(part) & set(state))
        if dup:
            raise ConversionError(f"{path}: keys repeated across shards: {dup[:8]}")
        state |= part
    return state


def family(keys: list[str]) -> str:
    """ "matrix-game-2" (action modules / image embedder present) or "self-forcing"."""
    if any(".action_model." in k or k.startswith("condition_embedder.image_embedder.") for k in keys):
        return "matrix-game-2"
    return "self-forcing"


def key_map(keys: list[str], target: dict[str, Shape], fam: str) -> KeyMap:
    """Identity onto `target`, FastVideo's patch-embedding name, and the deliberate drops."""
    out = KeyMap()
    for k in keys:
        name = (
            "patch_embedding." + k[len("patch_embedding.proj.") :]
            if k.startswith("patch_embedding.proj.")
            else k
        )
        if name in target:
            out.rename[k] = name
        elif ".action_model." in k and k.rsplit(".", 2)[-2] in matrix_game.UNUSED_NORMS:
            out.ignored[k] = "RMSNorm weight the original never applies"
        elif fam == "matrix-game-2" and k.startswith("condition_embedder.text_embedder."):
            out.ignored[k] = "Matrix-Game 2.0 has no text path"
    return out


def _variant(state: dict, original: dict | None, fam: str) -> tuple[str, dict]:
    if original is not None:
        return original.get("mode", "custom"), original
    if fam == "self-forcing":
        return "t2v-1.3b", self_forcing.PUBLISHED
    prefixed = {matrix_game.PREFIX + k: v for k, v in state.items() if ".action_model." in k}
    variant = matrix_game.detect_variant(prefixed)
    return variant, matrix_game.PUBLISHED[variant]


def targets(fam: str, original: dict) -> dict[str, Shape]:
    """Target key -> shape for a family and original config."""
    if fam == "self-forcing":
        return self_forcing.target_shapes(self_forcing.model_config(original))
    return matrix_game.target_shapes(original)


def check_shapes(source: dict[str, Shape], original: dict | None = None) -> tuple[str, str]:
    """Check a key -> shape table; returns (family, variant)."""
    fam = family(list(source))
    variant, cfg = _variant(source, original, fam)
    target = targets(fam, cfg)
    check(source, key_map(list(source), target, fam), target, f"fastvideo {fam} ({variant})")
    return fam, variant


def convert(src: Path, original: dict | None = None) -> tuple[dict[str, torch.Tensor], str, str, dict]:
    """(converted state dict, family, variant, original config) from a FastVideo directory/file."""
    state = read(src)
    fam = family(list(state))
    variant, cfg = _variant(state, original, fam)
    target = targets(fam, cfg)
    out = apply(state, key_map(list(state), target, fam), target, f"fastvideo {src.name} ({fam}, {variant})")
    return out, fam, variant, cfg

"""The sprite marker: per-cell DiT input channels that say where the player's sprite is relative
to each latent cell, computed from the tile-aligned latents themselves (`sprite_marker`). The
motion head reads it too. A DiT reads it through the generic input-feature seam of the causal Wan
(`models.causal_wan.InputFeatures`), registered as "sprite_marker" (models/tiny_world/loader.py);
the shipped DiT reads none (its config's `input_features` is null), the trainer's `--marker`
option builds DiTs that do (models/tiny_world/training/dit.py `with_marker`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from models.causal_wan import CausalWanConfig

FEATURES = "sprite_marker"  # the name the tiny world registers its input features under


@dataclass
class MarkerConfig:
    """Per-cell input channels that say where a sprite is relative to each latent cell, for
    tile-aligned latents with a sprite layer (models/tiny_world/fast_decoder.py): the view's phase on its
    canvas (cos, sin of 2 pi p / 2s per axis) and the sprite's centre in view pixels are the same
    in every cell, so without them a token learns where the player is relative to itself only by
    comparing those numbers with its own place, which RoPE does not give it (issue 11: the view
    walks through walls next to the player). The marker is computed from the latents themselves,
    so every pass (noisy chunk, clean history, cached or dense) sees the same function of its input."""

    phase: int  # first of the 4 phase channels (cos x, sin x, cos y, sin y)
    place: int  # first of the 2 sprite centre channels (x, y)
    mean: tuple[float, ...]  # the 6 raw = z * std + mean statistics of those channels, phase first
    std: tuple[float, ...]
    spatial: int = 8  # canvas pixels per cell
    frame_size: int = 64  # view pixels
    scale: float = 4.0  # view pixels per unit of a raw centre channel
    reach: float = 2.0  # cells: offsets saturate beyond this

    channels = 2  # marker channels appended to the latents: the sprite's offset from the cell, x and y


def marker_inputs(cfg: MarkerConfig) -> tuple[int, ...]:
    """The six latent channels a marker reads: the view's 4 phase channels, then the sprite's 2
    centre channels."""
    return (*range(cfg.phase, cfg.phase + 4), cfg.place, cfg.place + 1)


def marker_motion(values: torch.Tensor, cfg: MarkerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised values (B, 6, ...) of a frame's `marker_inputs` (a mean over its cells) -> the
    view's phase on its canvas (B, 2, ...) in px in [-s/2, 3s/2) and the sprite's centre relative
    to the view's centre (B, 2, ...) in px, x then y, unrounded, in the values' dtype."""
    shape = (1, 6) + (1,) * (values.dim() - 2)
    mean = torch.tensor(cfg.mean, dtype=values.dtype, device=values.device).view(shape)
    std = torch.tensor(cfg.std, dtype=values.dtype, device=values.device).view(shape)
    raw = values * std + mean
    s = cfg.spatial
    p = torch.atan2(raw[:, 1:4:2], raw[:, 0:4:2]) * (s / math.pi)  # in (-s, s]
    return torch.where(p < -s / 2, p + 2 * s, p), raw[:, 4:6] * cfg.scale


def sprite_marker(x: torch.Tensor, cfg: MarkerConfig) -> torch.Tensor:
    """Latents (B, C, F, H, W) -> marker channels (B, 2, F, H, W): the sprite's centre minus each
    cell's centre, in cells, clamped to +-reach and divided by it. The phase and the place are
    averaged over a frame's cells first (so a noisy frame's marker is its best estimate)."""
    p, offset = marker_motion(x[:, list(marker_inputs(cfg))].mean(dim=(3, 4)), cfg)  # (B, 2, F) each
    s = cfg.spatial
    centre = 2 * s + p + offset + cfg.frame_size / 2  # canvas pixels
    h, w = x.shape[3:]
    cx = torch.arange(w, device=x.device, dtype=x.dtype) * s + s / 2
    cy = torch.arange(h, device=x.device, dtype=x.dtype) * s + s / 2
    dx = (centre[:, 0, :, None, None] - cx) / s  # (B, F, 1, W)
    dy = (centre[:, 1, :, None, None] - cy[:, None]) / s  # (B, F, H, 1)
    out = torch.stack([dx.expand(-1, -1, h, w), dy.expand(-1, -1, h, w)], dim=1)
    return out.clamp(-cfg.reach, cfg.reach) / cfg.reach


class SpriteMarker:
    """The marker as the DiT's `InputFeatures`: latents -> (B, 2, F, H, W) `sprite_marker`."""

    channels = MarkerConfig.channels

    def __init__(self, cfg: MarkerConfig) -> None:
        self.cfg = cfg

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return sprite_marker(x, self.cfg)


def marker_spec(cfg: MarkerConfig) -> dict:
    """The `CausalWanConfig.input_features` entry of a DiT that reads this marker (JSON-ready, so a
    config equals itself after a save and load)."""
    spec = asdict(cfg)
    return {"name": FEATURES, **spec, "mean": list(spec["mean"]), "std": list(spec["std"])}


def marker_from_spec(spec: dict) -> MarkerConfig:
    """`marker_spec`'s inverse (JSON lists back to tuples)."""
    fields = {k: v for k, v in spec.items() if k != "name"}
    return MarkerConfig(**{**fields, "mean": tuple(fields["mean"]), "std": tuple(fields["std"])})


def load_features(spec: dict) -> SpriteMarker:
    """The registered factory: a config's `input_features` entry -> its `SpriteMarker`."""
    return SpriteMarker(marker_from_spec(spec))


def dit_marker(cfg: CausalWanConfig) -> MarkerConfig | None:
    """The marker a DiT config reads, None when it reads none."""
    spec = cfg.input_features
    if spec is None:
        return None
    if spec.get("name") != FEATURES:
        raise ValueError(f"the DiT reads input features {spec.get('name')!r}, not the sprite marker")
    return marker_from_spec(spec)


def dit_features(cfg: CausalWanConfig) -> SpriteMarker | None:
    """What `CausalWan(cfg, features)` needs for a tiny-world DiT config."""
    marker = dit_marker(cfg)
    return SpriteMarker(marker) if marker is not None else None

"""The tiny world's two sampler writes: `carry` starts chosen latent channels of a chunk's noise
from the history's latest frame, `pin` writes known channels into every clean estimate (the
plug-in's `pin`, models/tiny_world/plugin.py; the trainer unrolls the same arithmetic)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def carry(noise: torch.Tensor, last: torch.Tensor, channels: Sequence[int]) -> torch.Tensor:
    """Noise (B, C, n, h, w) whose `channels` hold `last` (B, C, 1, h, w) on every frame, written in
    place and returned: those channels then flow from the history's latest frame to the new one
    instead of from a random draw (a world trained so, e.g. the tiny world's player place)."""
    ch = list(channels)
    if ch:
        noise[:, ch] = last[:, ch].to(noise.dtype).expand(-1, -1, noise.shape[2], -1, -1)
    return noise


def pin(
    x: torch.Tensor, channels: Sequence[int], values: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Latents (B, C, n, h, w) whose `channels` hold `values` (B, len(channels), n), the same in
    every cell, in the entries `rows` (B,) bool marks (all when None); written in place and
    returned. Used on every clean estimate, so a chunk is sampled around what is known of it (a
    world's planned motion). A mask, not an index: no host sync."""
    ch = list(channels)
    b, _, n, h, w = x.shape
    vals = values[:b, :, :n, None, None].to(x.dtype).expand(-1, -1, -1, h, w)
    if rows is not None:
        vals = torch.where(rows[:b, None, None, None, None], vals, x[:, ch])
    x[:, ch] = vals
    return x

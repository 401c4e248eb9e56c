"""Modules trained beside the self-forced DiT, never shipped: the patch critic of `sf_adv` and
the auxiliary heads of `sf_marker_aux` / `sf_motion_aux`."""

from __future__ import annotations

import torch
from torch import nn

from models.tiny_world.marker import MarkerConfig
from models.tiny_world.metrics import KEY_AXES


class FrameCritic(nn.Module):
    """A small patch discriminator on 64x64 frames in [-1, 1]: (N, 3, H, W) -> (N, H/8 * W/8)
    logits, one per 8x8 patch (one game tile), spectrally normalised for a stable hinge game
    (PatchGAN / ADD style). It learns the game's look (flat tiles, its palette, crisp edges), so
    its loss asks a prediction to be a sample, where least squares alone asks for a mean."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.net = nn.Sequential(
            sn(nn.Conv2d(3, width, 4, 2, 1)),
            nn.LeakyReLU(0.2),
            sn(nn.Conv2d(width, 2 * width, 4, 2, 1)),
            nn.LeakyReLU(0.2),
            sn(nn.Conv2d(2 * width, 4 * width, 4, 2, 1)),
            nn.LeakyReLU(0.2),
            sn(nn.Conv2d(4 * width, 1, 3, 1, 1)),
        )

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.net(frames).flatten(1)


class AuxHeads(nn.Module):
    """Linear readouts from a DiT's last block tokens (B, F*T, dim), one token per patch of cells,
    for the self-forced phases' auxiliary losses (trained alongside, never shipped): `marker`,
    the sprite marker of the token's cells (`sprite_marker`, `sf_marker_aux`); `motion`, the
    token's frame's `key_motions` (`sf_motion_aux`)."""

    def __init__(self, dim: int, patch: tuple[int, int, int], marker: bool, motion: bool) -> None:
        super().__init__()
        self.patch = patch[1:]
        self.marker = nn.Linear(dim, MarkerConfig.channels * patch[1] * patch[2]) if marker else None
        self.motion = nn.Linear(dim, 2 * len(KEY_AXES)) if motion else None

    def marker_targets(self, marker: torch.Tensor) -> torch.Tensor:
        """The marker (B, 2, F, H, W) laid out as the tokens (B, F*T, 2*ph*pw), frame-major."""
        b, ch, f, h, w = marker.shape
        ph, pw = self.patch
        x = marker.view(b, ch, f, h // ph, ph, w // pw, pw).permute(0, 2, 3, 5, 1, 4, 6)
        return x.reshape(b, f * (h // ph) * (w // pw), ch * ph * pw)

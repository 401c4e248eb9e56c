"""Streaming, causal decode with diffusers' `AutoencoderKLWan`, one latent frame at a time.

The public `AutoencoderKLWan.decode()` clears its feature cache on every call, so it can only
decode whole clips. Here the cache is explicit state: `decode(latents, cache)` returns frames
and a *new* cache and never mutates the one passed in (the decoder only rebinds cache entries
to fresh tensors, so a shallow copy of the entry list is a private copy). That is what lets a
chunk transaction decode, then either commit the new cache or drop it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

from models.actions import FrameLayout


@dataclass(frozen=True)
class DecoderCache:
    """Decoder state of one stream: the causal convs' cached tail frames."""

    feats: tuple  # per causal conv: a tensor, the "Rep" marker, or None (entries are never mutated)
    frames: int  # latent frames decoded so far; 0 means the next one starts the stream


class StreamingDecoder(Protocol):
    """What a world needs from its autoencoder (Wan's VAE, or a lighter decoder of the same shape)."""

    layout: FrameLayout  # how latent frames expand into video frames
    spatial: int  # pixels per latent cell along each axis

    @property
    def latent_channels(self) -> int: ...

    def init_cache(self) -> DecoderCache: ...

    def decode(self, latents: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]: ...

    def encode(self, frames: np.ndarray) -> torch.Tensor: ...


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """(3, T, H, W) floats in [-1, 1] -> (T, H, W, 3) uint8 on the same device."""
    return ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()


class WanStreamingVAE:
    """A Wan VAE whose decoder runs causally over a stream of latent frames.

    Latents on the DiT side are normalised per channel: ``z_dit = (z_vae - mean) / std``.
    """

    def __init__(self, vae: AutoencoderKLWan) -> None:
        self.vae = vae.eval()
        cfg = vae.config
        z = cfg.z_dim
        mean = cfg.latents_mean if len(cfg.latents_mean) == z else [0.0] * z
        std = cfg.latents_std if len(cfg.latents_std) == z else [1.0] * z
        p = next(vae.parameters())
        self.mean = torch.tensor(mean, dtype=p.dtype, device=p.device).view(1, z, 1, 1, 1)
        self.std = torch.tensor(std, dtype=p.dtype, device=p.device).view(1, z, 1, 1, 1)
        self.n_convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.spatial = cfg.scale_factor_spatial
        self.layout = FrameLayout(frames_per_latent=cfg.scale_factor_temporal, first_is_single=True)

    @property
    def latent_channels(self) -> int:
        """Channels of a latent frame."""
        return self.vae.config.z_dim

    def init_cache(self) -> DecoderCache:
        """The cache of a stream that has decoded nothing yet."""
        return DecoderCache(feats=(None,) * self.n_convs, frames=0)

    @torch.no_grad()
    def decode_float(self, latents: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) normalised -> video (3, T, H, W) in [-1, 1] and the advanced cache."""
        z = latents[None].to(self.mean.dtype) * self.std + self.mean
        x = self.vae.post_quant_conv(z)
        feats = list(cache.feats)
        outs = []
        for i in range(x.shape[2]):
            first = cache.frames + i == 0
            outs.append(
                self.vae.decoder(x[:, :, i : i + 1], feat_cache=feats, feat_idx=[0], first_chunk=first)
            )
        video = torch.cat(outs, dim=2)[0].clamp(-1, 1)
        return video, DecoderCache(feats=tuple(feats), frames=cache.frames + x.shape[2])

    def decode(self, latents: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) -> frames (T, H, W, 3) uint8 and the advanced cache."""
        video, new = self.decode_float(latents, cache)
        return to_uint8(video), new

    @torch.no_grad()
    def encode(self, frames: np.ndarray) -> torch.Tensor:
        """frames (T, H, W, 3) uint8 -> normalised latents (C, n, h, w) (posterior mode)."""
        p = self.mean
        x = torch.from_numpy(np.ascontiguousarray(frames)).to(p.device, p.dtype)
        x = (x / 127.5 - 1.0).permute(3, 0, 1, 2)[None]  # (1, 3, T, H, W)
        z = self.vae.encode(x).latent_dist.mode()
        return ((z - self.mean) / self.std)[0]

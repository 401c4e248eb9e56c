"""Streaming, causal decode with diffusers' `AutoencoderKLWan`, one latent frame at a time.

The public `AutoencoderKLWan.decode()` clears its feature cache on every call, so it can only
decode whole clips. Here the cache is explicit state: `decode(latents, cache)` returns frames
and a *new* cache and never mutates the one passed in (the decoder only rebinds cache entries
to fresh tensors, so a shallow copy of the entry list is a private copy). That is what lets a
chunk transaction decode, then either commit the new cache or drop it.

Batched decode across sessions (for the runner's decode stage)::

    frames, caches = decode_batch(decoder, latents, caches)

`latents` is a (B, C, n, h, w) tensor or a list of B (C, n_b, h, w) chunks, `caches` the B
sessions' committed `DecoderCache`s; it returns B uint8 frame tensors (T_b, H, W, 3) on the
decoder's device and B new caches, each equal (fp32: within float error of a conv over a bigger
batch) to what `decoder.decode(latents[b], caches[b])` returns. Nothing passed in is mutated, so
a cancelled session keeps its old cache and the others commit theirs. Decoders with a batched
path (`WanStreamingVAE`, `TAEHVDecoder`) run sessions at the same stream phase as one forward;
any other decoder is looped. For the Wan VAE, sessions batch when their caches have the same
structure (a stream's first and second latent frames use different cache entries; every later
frame has the same shapes); a new cache's tensors are row views of the batch's cache tensors,
which are never written, so a kept old cache holds at most one batch's cache tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

from models.actions import FrameLayout


@dataclass(frozen=True)
class DecoderCache:
    """Decoder state of one stream (the Wan VAE: its causal convs' cached tail frames)."""

    feats: tuple  # decoder-specific entries, never mutated (Wan: per causal conv a tensor, "Rep" or None)
    frames: int  # latent frames decoded so far; 0 means the next one starts the stream


def cache_to_tensors(cache: DecoderCache) -> tuple[dict[str, torch.Tensor], dict]:
    """A decoder cache as tensors (entry i's tensor under "i") and JSON (the frame count and
    each entry's kind: "tensor", null, or the string it holds), for a session snapshot. Every
    decoder's `feats` entries are tensors, None or strings (Wan's "Rep"), so one format serves all."""
    tensors: dict[str, torch.Tensor] = {}
    kinds: list[str | None] = []
    for i, entry in enumerate(cache.feats):
        if isinstance(entry, torch.Tensor):
            tensors[str(i)] = entry.detach().contiguous()
            kinds.append("tensor")
        elif entry is None or isinstance(entry, str):
            kinds.append(None if entry is None else f"str:{entry}")
        else:
            raise TypeError(f"decoder cache entry {i} is a {type(entry).__name__}, not a tensor, None or str")
    return tensors, {"frames": cache.frames, "entries": kinds}


def cache_from_tensors(
    tensors: dict[str, torch.Tensor], meta: dict, device: torch.device | str
) -> DecoderCache:
    """Inverse of `cache_to_tensors`, the tensors moved to `device` (ValueError when they do not
    match the JSON)."""
    feats: list = []
    for i, kind in enumerate(meta["entries"]):
        if kind == "tensor":
            if str(i) not in tensors:
                raise ValueError(f"decoder cache entry {i} is missing")
            feats.append(tensors[str(i)].to(device))
        elif kind is None:
            feats.append(None)
        elif isinstance(kind, str) and kind.startswith("str:"):
            feats.append(kind[4:])
        else:
            raise ValueError(f"decoder cache entry {i} has an unknown kind {kind!r}")
    return DecoderCache(feats=tuple(feats), frames=int(meta["frames"]))


class StreamingDecoder(Protocol):
    """What a world needs from its autoencoder (Wan's VAE, or a lighter decoder of the same shape).

    Optional: `canonical(latents) -> latents`, applied by `World.context` to every generated
    chunk before it becomes history (the fast decoder's tile-aligned chunks are re-anchored and
    their phases snapped there).
    """

    layout: FrameLayout  # how latent frames expand into video frames
    spatial: int  # pixels per latent cell along each axis
    margin_cells: int  # latent cells per axis beyond the frame's (a tile-aligned canvas); mostly 0

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
        self.margin_cells = 0
        self.layout = FrameLayout(frames_per_latent=cfg.scale_factor_temporal, first_is_single=True)

    @property
    def latent_channels(self) -> int:
        """Channels of a latent frame."""
        return self.vae.config.z_dim

    def init_cache(self) -> DecoderCache:
        """The cache of a stream that has decoded nothing yet."""
        return DecoderCache(feats=(None,) * self.n_convs, frames=0)

    @torch.no_grad()
    def decode_float_batch(
        self, latents: Sequence[torch.Tensor], caches: Sequence[DecoderCache]
    ) -> tuple[list[torch.Tensor], list[DecoderCache]]:
        """Per session latents (C, n_b, h, w) normalised and caches -> videos (3, T_b, H, W) in
        [-1, 1] and the advanced caches; one decoder forward per latent frame and cache structure."""
        if len(latents) != len(caches):
            raise ValueError(f"{len(latents)} latent chunks for {len(caches)} caches")
        feats = [list(c.feats) for c in caches]
        outs: list[list[torch.Tensor]] = [[] for _ in caches]
        for i in range(max((z.shape[1] for z in latents), default=0)):
            live = [b for b, z in enumerate(latents) if z.shape[1] > i]
            groups: dict[tuple, list[int]] = {}
            for b in live:
                groups.setdefault(_structure(feats[b]), []).append(b)
            for group in groups.values():
                z = torch.stack([latents[b][:, i : i + 1] for b in group]).to(self.mean.dtype)
                x = self.vae.post_quant_conv(z * self.std + self.mean)  # (G, C, 1, h, w)
                batch = [_merge([feats[b][k] for b in group]) for k in range(self.n_convs)]
                first = caches[group[0]].frames + i == 0  # same structure: all first or none
                video = self.vae.decoder(x, feat_cache=batch, feat_idx=[0], first_chunk=first)
                for j, b in enumerate(group):
                    feats[b] = [_row(f, j, len(group)) for f in batch]
                    outs[b].append(video[j])
        videos = [torch.cat(o, dim=1).clamp(-1, 1) for o in outs]  # (3, T, H, W)
        new = [
            DecoderCache(feats=tuple(f), frames=c.frames + z.shape[1])
            for f, c, z in zip(feats, caches, latents, strict=True)
        ]
        return videos, new

    def decode_float(self, latents: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) normalised -> video (3, T, H, W) in [-1, 1] and the advanced cache."""
        (video,), (new,) = self.decode_float_batch([latents], [cache])
        return video, new

    def decode_batch(
        self, latents: Sequence[torch.Tensor], caches: Sequence[DecoderCache]
    ) -> tuple[list[torch.Tensor], list[DecoderCache]]:
        """Per session latents (C, n_b, h, w) -> frames (T_b, H, W, 3) uint8 and the advanced caches."""
        videos, new = self.decode_float_batch(latents, caches)
        return [to_uint8(v) for v in videos], new

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


def decode_batch(
    decoder: StreamingDecoder,
    latents: torch.Tensor | Sequence[torch.Tensor],
    caches: Sequence[DecoderCache],
) -> tuple[list[torch.Tensor], list[DecoderCache]]:
    """B sessions' latent chunks (B, C, n, h, w) or [(C, n_b, h, w)] and their caches -> B uint8
    frame tensors (T_b, H, W, 3) and B new caches, in one batched forward where the decoder has
    one (see the module docstring); the caches passed in are untouched."""
    chunks = list(latents.unbind(0)) if isinstance(latents, torch.Tensor) else list(latents)
    if len(chunks) != len(caches):
        raise ValueError(f"{len(chunks)} latent chunks for {len(caches)} caches")
    batched = getattr(decoder, "decode_batch", None)
    if batched is not None:
        return batched(chunks, caches)
    pairs = [decoder.decode(z, c) for z, c in zip(chunks, caches, strict=True)]
    return [f for f, _ in pairs], [c for _, c in pairs]


def _structure(feats: Sequence) -> tuple:
    """What must match for two Wan caches to batch: each entry's kind and per-row shape."""
    return tuple(f if not isinstance(f, torch.Tensor) else tuple(f.shape[1:]) for f in feats)


def _merge(entries: list):
    """One batched cache entry from the sessions' entries (all None, all "Rep", or tensors)."""
    first = entries[0]
    if not isinstance(first, torch.Tensor) or len(entries) == 1:
        return first
    return torch.cat(entries)


def _row(entry, j: int, rows: int):
    """Session j's cache entry from a batched one (a row view; the batch tensor is never written)."""
    if not isinstance(entry, torch.Tensor) or rows == 1:
        return entry
    return entry[j : j + 1]

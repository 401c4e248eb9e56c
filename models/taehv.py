"""TAEHV: a tiny causal video autoencoder that decodes Wan 2.1 latents chunk by chunk.

Reference (read, not copied): madebyollin/taehv (MIT), `taehv.py` at commit 1f14a56 (the base,
non-"super" architecture, unchanged for Wan 2.1 since a449c44 "Add TAEW2.1"). Its
`taew2_1.safetensors` weights load into `TAEHV(TAEHVConfig())` key for key: the parameter names
are the reference's `nn.Sequential` indices (`decoder.3.conv.0.weight`, `encoder.7.conv.weight`,
...), which is why both halves are `nn.ModuleList`s of numbered layers and parameter-free layers
(ReLU, Upsample, the soft clamp) keep their slots. Like the reference, TAEHV works on the latents
the diffusion model uses (Wan's normalised ones): no mean/std is applied.

Time is handled by three small layers; everything else is a per-frame 2-D conv::

    MemBlock  y_t = relu(convs(cat[x_t, x_{t-1}]) + x_t)   memory: the block's last input frame
    TPool     s consecutive frames side by side in channels -> 1x1 conv -> 1 frame   (encoder)
    TGrow     1 frame -> 1x1 conv to s*C channels -> s consecutive frames             (decoder)

    decoder  latents (B, n, 16, h, w)
             -> soft clamp, conv 16->256, relu
             -> [MemBlock x3, nearest up 2x, TGrow(1|2), conv to next width] x 3 stages
             -> relu, conv 64->3                        video (B, 4n, 3, 8h, 8w) in [0, 1]
             a stream's first latent frame keeps only its last video frame (Wan's layout)
    encoder  frames (B, T, 3, H, W) in [0, 1], T padded to a multiple of 4 with the last frame
             -> conv 3->64, relu -> [TPool(2|1), conv stride 2, MemBlock x3] x 3 -> conv 64->16

Streaming: the decoder's only state is each MemBlock's last input frame, and TGrow/Upsample are
per-frame, so decoding a chunk with the previous chunk's memories gives the frames a whole-clip
decode gives (same ops; only conv batch sizes differ). `TAEHVDecoder` keeps that memory in an
immutable `DecoderCache` (rollback = keep the old one) and decodes many sessions in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.actions import FrameLayout
from models.vae import DecoderCache, to_uint8


@dataclass
class TAEHVConfig:
    """Shape of a TAEHV; the defaults are `taew2_1` (Wan 2.1 latents, ~11 M parameters)."""

    latent_channels: int = 16  # C of a latent frame
    image_channels: int = 3  # RGB
    enc_width: int = 64  # encoder channels at every stage
    enc_time_down: tuple[bool, ...] = (True, True, False)  # per encoder stage: TPool stride 2 (else 1)
    dec_widths: tuple[int, ...] = (256, 128, 64, 64)  # decoder channels: 3 stages, then the output conv
    dec_time_up: tuple[bool, ...] = (False, True, True)  # per decoder stage: TGrow stride 2 (else 1)
    blocks: int = 3  # MemBlocks per stage (encoder and decoder)

    def __post_init__(self) -> None:
        self.enc_time_down = tuple(self.enc_time_down)
        self.dec_time_up = tuple(self.dec_time_up)
        self.dec_widths = tuple(self.dec_widths)
        if len(self.enc_time_down) != 3 or len(self.dec_time_up) != 3 or len(self.dec_widths) != 4:
            raise ValueError("TAEHV has 3 encoder stages, 3 decoder stages and 4 decoder widths")
        if sum(self.enc_time_down) != sum(self.dec_time_up):
            raise ValueError("encoder time downsampling must equal decoder time upsampling")
        if self.blocks < 1:
            raise ValueError("blocks must be >= 1")

    @property
    def spatial(self) -> int:
        """Pixels per latent cell along each axis (three 2x stages)."""
        return 8

    @property
    def temporal(self) -> int:
        """Video frames per latent frame."""
        return 2 ** sum(self.dec_time_up)

    @property
    def layout(self) -> FrameLayout:
        """Wan's layout: the first latent frame of a stream is one video frame, later ones `temporal`."""
        return FrameLayout(frames_per_latent=self.temporal, first_is_single=True)

    def to_dict(self) -> dict:
        """JSON-ready dict (round-trips through `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TAEHVConfig:
        """Inverse of `to_dict` (unknown keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_name(cls, name: str) -> TAEHVConfig:
        """A published config by name (`CONFIGS`)."""
        if name not in CONFIGS:
            raise ValueError(f"unknown TAEHV config {name!r}; known: {sorted(CONFIGS)}")
        return cls(**asdict(CONFIGS[name]))


CONFIGS = {"taew2_1": TAEHVConfig()}  # name -> config of published weights


# --- layers --------------------------------------------------------------------------------------


def conv3(n_in: int, n_out: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    """A 3x3 'same' conv (stride 2 halves the size)."""
    return nn.Conv2d(n_in, n_out, 3, stride=stride, padding=1, bias=bias)


class SoftClamp(nn.Module):
    """3 * tanh(x / 3): keeps out-of-range latents from blowing up the decoder."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """A residual block that also sees the previous frame's input: relu(convs(cat[x, past]) + x)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        # indices 0, 2, 4 hold the weights (the reference's key names); 1 and 3 are ReLUs
        self.conv = nn.Sequential(conv3(2 * ch, ch), nn.ReLU(), conv3(ch, ch), nn.ReLU(), conv3(ch, ch))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, past], dim=1)) + x)  # (N, C, H, W)


class TPool(nn.Module):
    """Time downsampling: `stride` consecutive frames side by side in channels, mixed by a 1x1 conv."""

    def __init__(self, ch: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(ch * stride, ch, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c, h, w = x.shape
        y = self.conv(x.reshape(b * t // self.stride, self.stride * c, h, w))  # oldest frame first
        return y.view(b, t // self.stride, c, h, w)


class TGrow(nn.Module):
    """Time upsampling: a 1x1 conv to `stride` times the channels, read as `stride` consecutive frames."""

    def __init__(self, ch: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(ch, ch * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c, h, w = x.shape
        y = self.conv(x.reshape(b * t, c, h, w))  # (B*T, s*C, H, W)
        return y.view(b, t * self.stride, c, h, w)  # channel block j -> frame t*s + j


def run_layers(
    layers: nn.ModuleList, x: torch.Tensor, memory: Sequence[torch.Tensor] | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Apply a layer list to clips x (B, T, C, H, W), all frames of a layer at once.

    `memory` holds, per MemBlock in order, the last input frame (B, C, H, W) of the clip before
    this one (None: the clips start here; zeros stand in). Returns the output clip and each
    MemBlock's new memory: the last frame of its input, copied so the cache does not keep the
    whole activation alive.
    """
    new_memory: list[torch.Tensor] = []
    for layer in layers:
        b, t = x.shape[:2]
        if isinstance(layer, MemBlock):
            # the previous frame of the clip's first frame: (B, 1, C, H, W)
            prev = x.new_zeros(b, 1, *x.shape[2:]) if memory is None else memory[len(new_memory)][:, None]
            past = torch.cat([prev, x[:, :-1]], dim=1)  # frame t sees frame t-1
            new_memory.append(x[:, -1].clone())
            x = layer(x.flatten(0, 1), past.flatten(0, 1)).view_as(x)
        elif isinstance(layer, (TPool, TGrow)):
            x = layer(x)
        else:
            y = layer(x.flatten(0, 1))  # per frame: (B*T, C', H', W')
            x = y.view(b, t, *y.shape[1:])
    return x, tuple(new_memory)


# --- the autoencoder -----------------------------------------------------------------------------


class TAEHV(nn.Module):
    """Encoder and decoder as numbered layer lists (the reference's state-dict keys)."""

    def __init__(self, cfg: TAEHVConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w, d = cfg.enc_width, cfg.dec_widths
        enc: list[nn.Module] = [conv3(cfg.image_channels, w), nn.ReLU()]
        for down in cfg.enc_time_down:
            enc += [TPool(w, 2 if down else 1), conv3(w, w, stride=2, bias=False)]
            enc += [MemBlock(w) for _ in range(cfg.blocks)]
        enc.append(conv3(w, cfg.latent_channels))
        self.encoder = nn.ModuleList(enc)
        dec: list[nn.Module] = [SoftClamp(), conv3(cfg.latent_channels, d[0]), nn.ReLU()]
        for i, up in enumerate(cfg.dec_time_up):
            dec += [MemBlock(d[i]) for _ in range(cfg.blocks)]
            dec += [nn.Upsample(scale_factor=2), TGrow(d[i], 2 if up else 1)]
            dec.append(conv3(d[i], d[i + 1], bias=False))
        dec += [nn.ReLU(), conv3(d[3], cfg.image_channels)]
        self.decoder = nn.ModuleList(dec)
        self.memory_shapes: list[tuple[int, int]] = []  # per decoder MemBlock: (channels, scale vs latent)
        scale = 1
        for m in self.decoder:
            scale *= 2 if isinstance(m, nn.Upsample) else 1
            if isinstance(m, MemBlock):
                self.memory_shapes.append((m.conv[0].out_channels, scale))

    def decode_clips(
        self, z: torch.Tensor, memory: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Latent clips z (B, n, C, h, w) -> raw video (B, n*temporal, 3, H, W) in [0, 1] and memory.

        No trimming: a stream's first latent frame yields `temporal` frames here too (see
        `TAEHVDecoder` for Wan's one-frame start).
        """
        x, mem = run_layers(self.decoder, z, memory)
        return x.clamp(0, 1), mem

    def encode_clips(self, frames: torch.Tensor) -> torch.Tensor:
        """Clips (B, T, 3, H, W) in [0, 1] -> latents (B, ceil(T / temporal), C, H/8, W/8)."""
        tf = self.cfg.temporal
        pad = -frames.shape[1] % tf
        if pad:
            frames = torch.cat([frames, frames[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
        z, _ = run_layers(self.encoder, frames, None)
        return z


# --- streaming -----------------------------------------------------------------------------------


class TAEHVDecoder:
    """`StreamingDecoder` over a `TAEHV`: the cache is each decoder MemBlock's last input frame.

    `decode(latents, cache)` returns a new cache and never mutates the one passed in: the cache
    holds only fresh one-frame copies (after a batched decode, a session's rows of them), which
    nothing writes. A cache with `frames == 0` and no tensors starts a stream; its first latent
    frame keeps only its last video frame. The decode runs a whole chunk per layer at once
    (memory O(chunk)); frames leave only at commit, so nothing is gained by going frame by frame.
    """

    def __init__(self, model: TAEHV) -> None:
        self.model = model.eval()
        self.layout = model.cfg.layout
        self.spatial = model.cfg.spatial
        self.margin_cells = 0

    @property
    def latent_channels(self) -> int:
        """Channels of a latent frame."""
        return self.model.cfg.latent_channels

    def init_cache(self) -> DecoderCache:
        """The cache of a stream that has decoded nothing yet."""
        return DecoderCache(feats=(), frames=0)

    @torch.no_grad()
    def decode_float_batch(
        self, latents: Sequence[torch.Tensor], caches: Sequence[DecoderCache]
    ) -> tuple[list[torch.Tensor], list[DecoderCache]]:
        """Per session latents (C, n_b, h, w) and caches -> videos (3, T_b, H, W) in [-1, 1] and caches.

        Sessions with the same n decode as one batch; fresh streams get zero memory.
        """
        if len(latents) != len(caches):
            raise ValueError(f"{len(latents)} latent chunks for {len(caches)} caches")
        p = next(self.model.parameters())
        trim = self.model.cfg.temporal - 1
        videos: list[torch.Tensor] = [p.new_empty(0)] * len(latents)
        new: list[DecoderCache] = list(caches)
        for group in _groups_by_frames(latents):
            z = torch.stack([latents[b].transpose(0, 1) for b in group])  # (G, n, C, h, w)
            z = z.to(p.device, p.dtype)
            memory = None
            if any(caches[b].feats for b in group):
                memory = [
                    torch.cat([self._memory(caches[b], k, z) for b in group])
                    for k in range(len(self.model.memory_shapes))
                ]  # per MemBlock (G, C_k, H_k, W_k)
            x, mem = self.model.decode_clips(z, memory)  # (G, n*tf, 3, H, W)
            for j, b in enumerate(group):
                video = x[j, trim:] if caches[b].frames == 0 else x[j]
                videos[b] = (video * 2 - 1).transpose(0, 1)  # (3, T, H, W)
                feats = tuple(m[j : j + 1] if len(group) > 1 else m for m in mem)
                new[b] = DecoderCache(feats=feats, frames=caches[b].frames + z.shape[1])
        return videos, new

    def _memory(self, cache: DecoderCache, k: int, z: torch.Tensor) -> torch.Tensor:
        """MemBlock k's memory (1, C, H, W) from a cache; zeros for a fresh stream (z: its batch)."""
        if cache.feats:
            return cache.feats[k]
        ch, scale = self.model.memory_shapes[k]
        return z.new_zeros(1, ch, z.shape[3] * scale, z.shape[4] * scale)

    def decode_batch(
        self, latents: Sequence[torch.Tensor], caches: Sequence[DecoderCache]
    ) -> tuple[list[torch.Tensor], list[DecoderCache]]:
        """Per session latents (C, n_b, h, w) -> frames (T_b, H, W, 3) uint8 and the advanced caches."""
        videos, new = self.decode_float_batch(latents, caches)
        return [to_uint8(v) for v in videos], new

    def decode_float(self, latents: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) -> video (3, T, H, W) in [-1, 1] and the advanced cache."""
        (video,), (new,) = self.decode_float_batch([latents], [cache])
        return video, new

    def decode(self, latents: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) -> frames (T, H, W, 3) uint8 and the advanced cache."""
        video, new = self.decode_float(latents, cache)
        return to_uint8(video), new

    @torch.no_grad()
    def encode(self, frames: np.ndarray) -> torch.Tensor:
        """frames (T, H, W, 3) uint8 -> latents (C, ceil(T / temporal), h, w)."""
        p = next(self.model.parameters())
        x = torch.from_numpy(np.ascontiguousarray(frames)).to(p.device, p.dtype)
        x = (x / 255.0).permute(0, 3, 1, 2)[None]  # (1, T, 3, H, W)
        return self.model.encode_clips(x)[0].transpose(0, 1)  # (C, n, h, w)


def _groups_by_frames(latents: Sequence[torch.Tensor]) -> list[list[int]]:
    """Session indices grouped by latent frame count (each group decodes as one batch)."""
    groups: dict[int, list[int]] = {}
    for b, z in enumerate(latents):
        groups.setdefault(z.shape[1], []).append(b)
    return list(groups.values())

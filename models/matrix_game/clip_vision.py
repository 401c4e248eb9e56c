"""The CLIP ViT-H/14 visual tower Matrix-Game 2.0 conditions on (our torch, the original's weights).

Loads the `visual.*` keys of `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` (the text
tower and `log_scale` are not needed) under the same names minus the `visual.` prefix. Written
from the behaviour of the original (Wan's `clip.py` VisionTransformer: pre-norm ViT, exact GELU,
class token, learned positions) and checked against it by tests/fixtures/golden/clip_vision_tiny.

Matrix-Game feeds the DiT the hidden states after all blocks but the last (`use_31_block`): 257
tokens of width 1280 for one 224x224 image. `encode` also does the original's preprocessing of a
frame in [-1, 1]: bicubic resize to 224x224, back to [0, 1], CLIP mean/std normalisation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class CLIPVisionConfig:
    """Sizes of the tower (defaults: ViT-H/14 of open-clip-xlm-roberta-large-vit-huge-14)."""

    image_size: int = 224
    patch_size: int = 14
    dim: int = 1280
    mlp_ratio: float = 4.0
    num_heads: int = 16
    num_layers: int = 32
    out_dim: int = 1024  # width of the (unused here) pooled projection `head`
    eps: float = 1e-5

    @property
    def tokens(self) -> int:
        """Output tokens: the class token plus one per patch."""
        return (self.image_size // self.patch_size) ** 2 + 1

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.to_qkv(x).view(b, s, 3, self.heads, c // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(o.transpose(1, 2).reshape(b, s, c))


class _Block(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig) -> None:
        super().__init__()
        hidden = int(cfg.dim * cfg.mlp_ratio)
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.attn = _Attention(cfg.dim, cfg.num_heads)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, hidden), nn.GELU(), nn.Linear(hidden, cfg.dim), nn.Dropout(0.0)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x.float()).type_as(x))
        return x + self.mlp(self.norm2(x.float()).type_as(x))


class CLIPVision(nn.Module):
    """ViT visual tower; parameter names are the original's minus `visual.`."""

    def __init__(self, cfg: CLIPVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n = cfg.tokens
        self.patch_embedding = nn.Conv2d(3, cfg.dim, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.cls_embedding = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embedding = nn.Parameter(torch.zeros(1, n, cfg.dim))
        self.pre_norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.transformer = nn.Sequential(*[_Block(cfg) for _ in range(cfg.num_layers)])
        # Loaded so the file maps key for key; Matrix-Game never runs them (see `forward`).
        self.post_norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.head = nn.Parameter(torch.zeros(cfg.dim, cfg.out_dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised pixels (B, 3, S, S) -> hidden states after all blocks but the last (B, N, dim)."""
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_embedding.expand(x.shape[0], -1, -1).to(x), x], dim=1)
        x = self.pre_norm((x + self.pos_embedding.to(x)).float()).type_as(x)
        for block in self.transformer[:-1]:
            x = block(x)
        return x

    def preprocess(self, frames: torch.Tensor) -> torch.Tensor:
        """Frames in [-1, 1] (B, 3, H, W) of any size -> the tower's normalised input."""
        size = (self.cfg.image_size, self.cfg.image_size)
        x = F.interpolate(frames, size=size, mode="bicubic", align_corners=False)
        x = x * 0.5 + 0.5
        mean = torch.tensor(MEAN, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        return (x - mean) / std

    @torch.no_grad()
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """Frames in [-1, 1] (B, 3, H, W) -> image tokens (B, N, dim), as Matrix-Game conditions on."""
        return self(self.preprocess(frames))

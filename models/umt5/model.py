"""The UMT5 encoder: token ids -> one hidden state per token (Wan's text encoder, UMT5-XXL).

A plain pre-norm transformer encoder in the T5 style: RMS norms without bias, attention without
the 1/sqrt(d) scale, a learned relative-position bias in every layer (UMT5: not shared between
layers), and a gated tanh-GELU feed-forward. `UMT5Config()` is the published UMT5-XXL encoder
(5.7 B parameters); tests build a tiny one with the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class UMT5Config:
    """Shapes of the encoder; the defaults are UMT5-XXL as Wan uses it."""

    vocab: int = 256384
    dim: int = 4096
    heads: int = 64
    head_dim: int = 64
    ffn: int = 10240
    layers: int = 24
    buckets: int = 32  # relative-position buckets (half for each direction)
    max_distance: int = 128  # distances past this share the last bucket
    eps: float = 1e-6
    text_len: int = 512  # tokens a prompt may take, its end-of-sequence token included

    def params(self) -> int:
        """Parameter count (embedding, layers, final norm)."""
        inner = self.heads * self.head_dim
        layer = 4 * self.dim * inner + 3 * self.dim * self.ffn + self.buckets * self.heads + 2 * self.dim
        return self.vocab * self.dim + self.layers * layer + self.dim


class RMSNorm(nn.Module):
    """T5's layer norm: scale by the root mean square (computed in float32), no mean, no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x * scale).to(self.weight.dtype)


def relative_buckets(length: int, buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """(length, length) bucket of key position j seen from query position i (bidirectional):
    half the buckets for keys after the query; within a direction, distances below a quarter of
    the buckets get one bucket each, longer ones share log-spaced buckets up to max_distance."""
    pos = torch.arange(length, device=device)
    rel = pos[None, :] - pos[:, None]
    half = buckets // 2
    exact = half // 2
    dist = rel.abs()
    far = (
        exact
        + (
            torch.log(dist.clamp(min=1).float() / exact) / math.log(max_distance / exact) * (half - exact)
        ).long()
    )
    far = far.clamp(max=half - 1)
    return (rel > 0).long() * half + torch.where(dist < exact, dist, far)


class Attention(nn.Module):
    """Self-attention with a learned relative-position bias and no 1/sqrt(d) scale."""

    def __init__(self, cfg: UMT5Config) -> None:
        super().__init__()
        inner = cfg.heads * cfg.head_dim
        self.cfg = cfg
        self.q = nn.Linear(cfg.dim, inner, bias=False)
        self.k = nn.Linear(cfg.dim, inner, bias=False)
        self.v = nn.Linear(cfg.dim, inner, bias=False)
        self.o = nn.Linear(inner, cfg.dim, bias=False)
        self.rel_bias = nn.Embedding(cfg.buckets, cfg.heads)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        h, d = self.cfg.heads, self.cfg.head_dim
        q, k, v = (proj(x).view(b, n, h, d).transpose(1, 2) for proj in (self.q, self.k, self.v))
        buckets = relative_buckets(n, self.cfg.buckets, self.cfg.max_distance, x.device)
        bias = self.rel_bias(buckets).permute(2, 0, 1)[None].to(q.dtype)  # (1, H, N, N)
        if key_bias is not None:
            bias = bias + key_bias
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(out.transpose(1, 2).reshape(b, n, h * d))


class FeedForward(nn.Module):
    """Gated GELU (tanh approximation): w2(gelu(w1(x)) * w3(x))."""

    def __init__(self, cfg: UMT5Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


class Block(nn.Module):
    """One pre-norm encoder layer."""

    def __init__(self, cfg: UMT5Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), key_bias)
        return x + self.ffn(self.ffn_norm(x))


class UMT5Encoder(nn.Module):
    """Token ids (B, N) -> last hidden states (B, N, dim)."""

    def __init__(self, cfg: UMT5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` (B, N), 1 for real tokens: padded keys are not attended to (their own rows are
        computed but meaningless). A single unpadded prompt needs no mask."""
        x = self.tok_emb(ids)
        key_bias = None
        if mask is not None:
            neg = torch.finfo(x.dtype).min
            key_bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device)
            key_bias = key_bias.masked_fill(mask == 0, neg)[:, None, None, :]
        for block in self.blocks:
            x = block(x, key_bias)
        return self.norm(x)

"""Causal Wan: the block-causal, KV-cached Wan2.1 DiT that Self-Forcing and Matrix-Game 2.0 roll out.

References (read, not copied): diffusers `WanTransformer3DModel` (blocks, weight layout, RoPE
tables), Self-Forcing / CausVid (chunk-wise rollout over a KV cache, RoPE with a frame offset,
local window + sink), Matrix-Game 2.0 (an action module in the first blocks: mouse through an
MLP and temporal attention, keyboard through cross-attention), gpt-fast (`setup_caches`: a static
cache owned by the model; the model file has no loop over sessions).

The module tree and parameter names are diffusers' (`patch_embedding`, `condition_embedder`,
`blocks.N.attn1.to_q`, ...), built from diffusers' own submodules, so a diffusers checkpoint's
state dict loads key for key; the action module adds `blocks.N.action.*`.

Two forwards share every block, which calls one pluggable attention (models/kv_pool.py):

* `forward_chunk` runs one chunk of new latent frames for every entry of a batch against the
  model's static K/V pool (`setup_caches`). Each entry writes its chunk's K/V into scratch slots
  of its session's row (`ChunkIndex.write`) and attends, under a per-slot mask (`ChunkIndex.valid`),
  over the frames before it in its window plus the chunk itself. Committed slots are only ever read;
  whether the scratch becomes history is the caller's decision. One batched call per layer, shapes
  that depend on the batch size only (torch.compile / CUDA graphs), no host sync.
* `forward_dense` runs whole clips with one timestep per frame under a frame-level attention
  mask (training, and the reference the cached path is tested against).

Token layout: frame-major, ``token = frame * (h * w) + row * w + col`` after 1x2x2 patching.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Protocol

import torch
from diffusers.models.attention import FeedForward
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    WanTimeTextImageEmbedding,
)
from torch import nn

from models.actions import ActionSpace
from models.kv_pool import ChunkIndex, DenseAttention, KVPool, PoolAttention, sdpa
from models.matrix_game.action import (
    MGActionConfig,
    MGActionModule,
    forward_pooled,
    ring_windows,
    rope_tables,
)

ACTION_KINDS = ("worldserve", "matrix-game")  # ActionConfig.kind values


@dataclass
class ActionConfig:
    """The action module, present in blocks [0, blocks).

    `kind` selects the module: "worldserve" (`ActionModule`, our design, trained by the tiny
    world) or "matrix-game" (`models.matrix_game.action.MGActionModule`, weight-compatible with Matrix-Game
    2.0 checkpoints; its own sizes are the `matrix_game` dict, an `MGActionConfig`). For
    "matrix-game", `keys` name the keyboard columns in the original's order, and protocol mouse
    deltas (dx, dy) become the original's [pitch, yaw] = [-dy, dx] * `mouse_scale`.
    """

    kind: str = "worldserve"
    matrix_game: dict | None = None  # MGActionConfig.to_dict() when kind == "matrix-game"
    keys: tuple[str, ...] = ("w", "a", "s", "d")  # key names, multi-hot order
    mouse: bool = True  # read per-frame mouse deltas
    vector_dim: int = 0  # continuous action width (robotics); 0 = none
    frames_per_latent: int = 4  # video frames grouped under one latent frame (VAE temporal factor)
    blocks: int = 15  # number of leading blocks that carry an action module
    key_dim: int = 256  # width of the keyboard cross-attention
    motion_dim: int = 1024  # width of the mouse/vector MLP and temporal attention
    heads: int = 16  # heads of both action attentions
    mouse_scale: float = 1.0  # multiplies raw mouse deltas before the MLP
    rope_theta: float = 10000.0  # RoPE base of the temporal (frame-axis) attention

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; known: {list(ACTION_KINDS)}")
        if self.kind == "matrix-game" and self.matrix_game is None:
            raise ValueError("a matrix-game action config needs its `matrix_game` (MGActionConfig) dict")

    @functools.cached_property
    def mg(self) -> MGActionConfig:
        """The Matrix-Game module config (kind "matrix-game" only); built once."""
        if self.kind != "matrix-game" or self.matrix_game is None:
            raise ValueError("not a matrix-game action config")
        return MGActionConfig.from_dict(self.matrix_game)

    @property
    def kv_sets(self) -> int:
        """Per-token temporal K/V sets per action layer in the pool (`ak`, `av`): the mouse /
        vector's (Matrix-Game's keyboard K/V is one token per frame, a row extra)."""
        if self.kind == "matrix-game":
            return int(self.mg.enable_mouse)
        return int(self.mouse or self.vector_dim > 0)

    @property
    def kv_width(self) -> int:
        """Width (heads x head_dim) of one action K or V token."""
        if self.kind == "matrix-game":
            return self.mg.heads_num * 64
        return self.heads * (self.motion_dim // self.heads)

    @property
    def space(self) -> ActionSpace:
        """The client-facing action space."""
        return ActionSpace(keys=tuple(self.keys), mouse=self.mouse, vector_dim=self.vector_dim)


class InputFeatures(Protocol):
    """Extra per-cell input channels a world computes from the latents themselves: (B, C, F, H, W)
    -> (B, `channels`, F, H, W), appended to the DiT's input in every pass (noisy chunk, clean
    history, cached or dense), so every pass sees the same function of its input. A family
    registers a factory (spec dict -> InputFeatures) under a name (models/registry.py kind
    "input_features"); `CausalWanConfig.input_features` names it with its settings."""

    channels: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class CausalWanConfig:
    """diffusers' `WanTransformer3DModel` config plus the causal rollout settings."""

    # diffusers fields (defaults: Wan2.1-T2V-1.3B)
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) patch; t must be 1 for frame-wise caching
    num_attention_heads: int = 12
    attention_head_dim: int = 128
    in_channels: int = 16  # latent channels in
    out_channels: int = 16  # latent channels out
    text_dim: int = 4096  # text-encoder embedding width (UMT5-XXL)
    freq_dim: int = 256  # sinusoidal timestep embedding width
    ffn_dim: int = 8960
    num_layers: int = 30
    cross_attn_norm: bool = True
    eps: float = 1e-6
    rope_max_seq_len: int = 1024  # kept for config round-trips; our RoPE has no table limit
    # causal rollout
    chunk_frames: int = 3  # latent frames per chunk
    window_frames: int = 21  # local attention span in latent frames, the current chunk included
    sink_frames: int = 0  # first frames of a session kept in attention forever
    null_text_len: int = 1  # text tokens used when a session has no prompt embedding
    max_text_len: int = 0  # prompt tokens a session may bring (0: null_text_len); text K/V slots per row
    action: ActionConfig | None = None  # None: no action module
    image_dim: int | None = None  # I2V (Matrix-Game): CLIP token width; cross-attention reads img_emb(tokens)
    cond_frames: int = 0  # I2V: latent frames of per-session conditioning kept (later frames reuse the last)
    # {"name": ..., settings}: extra input channels a registered function computes from the
    # latents (`InputFeatures`); None: the latents alone
    input_features: dict | None = None
    # keep each row's clean latents of its cached frames (a pool extra, "latents"): what a prompt
    # switch's re-cache recomputes the K/V from (WorldConfig.prompt_switch "recache")
    keep_latents: bool = False

    @property
    def dim(self) -> int:
        """Hidden width."""
        return self.num_attention_heads * self.attention_head_dim

    def tokens_per_frame(self, h: int, w: int) -> int:
        """Tokens of one latent frame of size (h, w)."""
        return (h // self.patch_size[1]) * (w // self.patch_size[2])

    @property
    def text_tokens(self) -> int:
        """Text K/V slots of a pool row: the longest prompt a session may bring."""
        return max(self.max_text_len, self.null_text_len)

    def kv_bytes(
        self, tokens_per_frame: int, itemsize: int, text_tokens: int | None = None, slack_frames: int = 0
    ) -> int:
        """Bytes of one session's row of the K/V pool (`KVPool.row_nbytes`): every layer's K and V
        over (sink + window + slack) frames, its text K/V (`text_tokens`, default
        `self.text_tokens`), plus the action module's temporal K/V (`ActionConfig.kv_sets`) and
        the per-row extras (I2V conditioning latents, the Matrix-Game raw action ring;
        `row_extras`)."""
        slots = (self.sink_frames + self.window_frames + slack_frames) * tokens_per_frame
        text = self.text_tokens if text_tokens is None else text_tokens
        total = self.num_layers * (slots + text) * self.dim * 2 * itemsize
        a = self.action
        if a is not None and a.kv_sets:
            layers = min(a.blocks, self.num_layers)
            total += a.kv_sets * layers * slots * a.kv_width * 2 * itemsize
        ph, pw = self.patch_size[1:]
        for shape in self.row_extras(tokens_per_frame * ph * pw, slack_frames).values():
            total += math.prod(shape) * itemsize
        return total

    def row_extras(self, latent_pixels: int, slack_frames: int = 0) -> dict[str, tuple[int, ...]]:
        """Per-row pool tensors besides K/V (`KVPool` extras) for latents of `latent_pixels` = h*w:
        the clean latents of the cached frames (`keep_latents`: frame slots, out_channels, h*w),
        the I2V conditioning (channels, cond_frames, h*w), the Matrix-Game raw action ring and its
        keyboard K/V (action layers, frame slots, heads, 64). `slack_frames` latent frames of room
        for a second chunk in flight (runtime/kv_cache.py)."""
        out: dict[str, tuple[int, ...]] = {}
        if self.keep_latents:
            frames = self.sink_frames + self.window_frames + slack_frames
            out["latents"] = (frames, self.out_channels, latent_pixels)
        if self.in_channels > self.out_channels:
            out["cond"] = (self.in_channels - self.out_channels, max(self.cond_frames, 1), latent_pixels)
        a = self.action
        if a is not None and a.kind == "matrix-game":
            mg = a.mg
            ring = mg.vae_time_compression_ratio * (self.chunk_frames + mg.windows_size + slack_frames)
            out["act_ring"] = (ring, mg.keyboard_dim_in + mg.mouse_dim_in)
            if mg.enable_keyboard:
                frames = self.sink_frames + self.window_frames + slack_frames
                kv = (min(a.blocks, self.num_layers), frames, mg.heads_num, 64)
                out["kb_k"], out["kb_v"] = kv, kv
        return out

    def diffusers_config(self) -> dict:
        """The subset of fields `WanTransformer3DModel(**cfg)` takes."""
        return {
            "patch_size": list(self.patch_size),
            "num_attention_heads": self.num_attention_heads,
            "attention_head_dim": self.attention_head_dim,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "text_dim": self.text_dim,
            "freq_dim": self.freq_dim,
            "ffn_dim": self.ffn_dim,
            "num_layers": self.num_layers,
            "cross_attn_norm": self.cross_attn_norm,
            "eps": self.eps,
            "rope_max_seq_len": self.rope_max_seq_len,
        }

    def to_dict(self) -> dict:
        """JSON-ready dict (round-trips through `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CausalWanConfig:
        """Build from `to_dict()` output or a diffusers `config.json` (unknown keys ignored)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        if "patch_size" in kwargs:
            kwargs["patch_size"] = tuple(kwargs["patch_size"])
        if data.get("added_kv_proj_dim"):
            raise ValueError("Wan I2V checkpoints with added image K/V projections are not supported yet")
        action = kwargs.get("action")
        if isinstance(action, dict):
            action = dict(action)
            action["keys"] = tuple(action.get("keys", ()))
            kwargs["action"] = ActionConfig(**action)
        return cls(**kwargs)


@dataclass
class TextKV:
    """Per-layer cross-attention K/V of one session's text conditioning (constant per session)."""

    k: list[torch.Tensor] = field(default_factory=list)  # per layer (L_text, heads, head_dim)
    v: list[torch.Tensor] = field(default_factory=list)  # per layer (L_text, heads, head_dim)


# --- rotary embeddings -------------------------------------------------------------------------


def _axis_freqs(dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (*positions.shape, dim) for integer positions, as diffusers' table rows."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    freqs = positions.to(torch.float64)[..., None] * inv  # (..., dim/2)
    return (
        freqs.cos().repeat_interleave(2, dim=-1).float(),
        freqs.sin().repeat_interleave(2, dim=-1).float(),
    )


def spatial_rope(
    head_dim: int, h: int, w: int, theta: float = 1e4, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (h, w) part of Wan's 3D RoPE: cos, sin (h*w, 2 * (2 * (head_dim // 6))), the same for
    every frame, so a model builds it once per latent size (`CausalWan.setup_caches`)."""
    hw_dim = 2 * (head_dim // 6)
    fh = _axis_freqs(hw_dim, torch.arange(h, device=device), theta)
    fw = _axis_freqs(hw_dim, torch.arange(w, device=device), theta)
    return tuple(  # type: ignore[return-value]
        torch.cat([fh[i][:, None].expand(h, w, -1), fw[i][None].expand(h, w, -1)], dim=-1).reshape(h * w, -1)
        for i in range(2)
    )


def rope_3d(
    head_dim: int,
    frame_pos: torch.Tensor,
    h: int,
    w: int,
    theta: float = 1e4,
    spatial: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's 3D RoPE for frames at RoPE indices `frame_pos` (B, F) int64: cos, sin of
    (B, F*h*w, 1, head_dim). Frame indices are a tensor, so one call serves a whole batch.
    `spatial`: the cached `spatial_rope` tables (built here when None); only the frame part,
    (B, F) positions, is computed per call."""
    t_dim = head_dim - 4 * (head_dim // 6)
    b, f = frame_pos.shape
    hw = h * w
    ft = _axis_freqs(t_dim, frame_pos, theta)
    sp = spatial if spatial is not None else spatial_rope(head_dim, h, w, theta, frame_pos.device)
    out = []
    for i in range(2):  # cos, then sin
        t = ft[i].view(b, f, 1, -1).expand(b, f, hw, -1)
        out.append(torch.cat([t, sp[i].expand(b, f, hw, -1)], dim=-1).reshape(b, f * hw, 1, head_dim))
    return out[0], out[1]


def frame_rope(
    head_dim: int, frame_pos: torch.Tensor, tokens_per_frame: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """1D RoPE along frames, one position per frame: cos, sin (B, F*T, 1, head_dim)."""
    cos, sin = _axis_freqs(head_dim, frame_pos, theta)  # (B, F, hd)
    t = tokens_per_frame
    return cos.repeat_interleave(t, dim=1)[:, :, None], sin.repeat_interleave(t, dim=1)[:, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (..., L, heads, head_dim) by tables (..., L, 1, head_dim)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


def frame_attention_mask(
    chunk_sizes: Sequence[int], window_frames: int, sink_frames: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Frame-level mask (F, F), True = may attend, matching the cached rollout exactly.

    A chunk of n frames starting at frame s sees itself, the sinks [0, min(S, s)) and the most
    recent committed non-sink frames [max(S, s - (W - n)), s).
    """
    total = sum(chunk_sizes)
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    s = 0
    for n in chunk_sizes:
        if n > window_frames:
            raise ValueError(f"chunk of {n} frames exceeds the window of {window_frames}")
        rows = slice(s, s + n)
        mask[rows, s : s + n] = True
        mask[rows, : min(sink_frames, s)] = True
        mask[rows, max(sink_frames, s - (window_frames - n)) : s] = True
        s += n
    return mask


Attention = PoolAttention | DenseAttention  # the pluggable attention every block calls


# --- action module -----------------------------------------------------------------------------


class ActionModule(nn.Module):
    """Injects per-frame actions into hidden states (our design after Matrix-Game 2.0).

    keyboard: the frame's tokens cross-attend to one token per (video frame, key), built from a
        key embedding, a within-group frame embedding and a held/not-held term.
    motion (mouse + vector): an MLP over [hidden token, the frame's motion values], then
        self-attention along the frame axis at every spatial position, block-causal and cached
        like the main attention (its K/V live in the pool's `ak/av`).
    """

    def __init__(self, dim: int, cfg: ActionConfig, eps: float) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_keys = len(cfg.keys)
        tpl = cfg.frames_per_latent
        self.motion_width = 2 * int(cfg.mouse) + cfg.vector_dim
        self.norm = FP32LayerNorm(dim, eps, elementwise_affine=False)
        if self.n_keys:
            kd = cfg.key_dim
            self.key_embed = nn.Parameter(torch.randn(self.n_keys, kd) * 0.02)
            self.key_frame = nn.Parameter(torch.randn(tpl, kd) * 0.02)
            self.key_held = nn.Parameter(torch.randn(kd) * 0.02)
            self.key_q = nn.Linear(dim, kd)
            self.key_kv = nn.Linear(kd, 2 * kd)
            self.key_norm_q = nn.RMSNorm(kd // cfg.heads, eps=eps)
            self.key_norm_k = nn.RMSNorm(kd // cfg.heads, eps=eps)
            self.key_out = nn.Linear(kd, dim)
        if self.motion_width:
            md = cfg.motion_dim
            self.motion_mlp = nn.Sequential(
                nn.Linear(dim + tpl * self.motion_width, md),
                nn.GELU(approximate="tanh"),
                nn.Linear(md, md),
                nn.LayerNorm(md),
            )
            self.motion_qkv = nn.Linear(md, 3 * md)
            self.motion_norm_q = nn.RMSNorm(md // cfg.heads, eps=eps)
            self.motion_norm_k = nn.RMSNorm(md // cfg.heads, eps=eps)
            self.motion_out = nn.Linear(md, dim)

    @property
    def motion_heads(self) -> tuple[int, int]:
        """(heads, head_dim) of the temporal attention, for sizing the cache."""
        return self.cfg.heads, self.cfg.motion_dim // self.cfg.heads

    def forward(self, x: torch.Tensor, actions: torch.Tensor, layer: int, attn: Attention) -> torch.Tensor:
        """x (B, F*T, dim); actions (B, F, frames_per_latent, width). Returns x plus the action signal."""
        b, n_tok, _ = x.shape
        t = attn.tokens_per_frame
        n = n_tok // t
        h = self.norm(x.float()).type_as(x)
        out = torch.zeros_like(x)
        acts = actions.to(x.dtype)
        if self.n_keys:
            out = out + self._keyboard(h, acts[..., : self.n_keys], b, n, t)
        if self.motion_width:
            motion = acts[..., self.n_keys : self.n_keys + 2 + self.cfg.vector_dim]
            if not self.cfg.mouse:
                motion = motion[..., 2:]
            elif self.cfg.mouse_scale != 1.0:
                motion = torch.cat([motion[..., :2] * self.cfg.mouse_scale, motion[..., 2:]], dim=-1)
            out = out + self._motion(h, motion, layer, attn, b, n, t)
        return x + out

    def _keyboard(self, h: torch.Tensor, held: torch.Tensor, b: int, n: int, t: int) -> torch.Tensor:
        heads, kd = self.cfg.heads, self.cfg.key_dim
        tpl = held.shape[2]
        # one token per (video frame in the group, key): (B, F, tpl, K, kd)
        tok = self.key_embed + self.key_frame[:, None, :] + held[..., None] * self.key_held
        tok = tok.reshape(b * n, tpl * self.n_keys, kd)
        k, v = self.key_kv(tok).chunk(2, dim=-1)
        q = self.key_q(h).reshape(b * n, t, heads, kd // heads)  # (B*F, T, heads, hd)
        k = k.reshape(b * n, -1, heads, kd // heads)
        v = v.reshape(b * n, -1, heads, kd // heads)
        o = sdpa(self.key_norm_q(q), self.key_norm_k(k), v)  # (B*F, T, heads, hd)
        return self.key_out(o.reshape(b, n * t, kd))

    def _motion(
        self, h: torch.Tensor, motion: torch.Tensor, layer: int, attn: Attention, b: int, n: int, t: int
    ) -> torch.Tensor:
        heads, hd = self.motion_heads
        per_frame = motion.reshape(b, n, 1, -1).expand(b, n, t, -1).reshape(b, n * t, -1)
        m = self.motion_mlp(torch.cat([h, per_frame], dim=-1))
        q, k, v = self.motion_qkv(m).reshape(b, n * t, 3, heads, hd).unbind(2)  # (B, F*T, heads, hd)
        cos, sin = attn.motion_rope
        q, k = apply_rope(self.motion_norm_q(q), cos, sin), apply_rope(self.motion_norm_k(k), cos, sin)
        return self.motion_out(attn.motion_attn(layer, q, k, v))


# --- transformer block -------------------------------------------------------------------------


class CausalWanBlock(nn.Module):
    """A Wan2.1 block (diffusers submodules and names); its attention goes through `attn`."""

    def __init__(self, cfg: CausalWanConfig, index: int) -> None:
        super().__init__()
        dim, heads = cfg.dim, cfg.num_attention_heads
        self.heads = heads
        self.norm1 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.attn1 = WanAttention(
            dim=dim, heads=heads, dim_head=dim // heads, eps=cfg.eps, processor=WanAttnProcessor()
        )
        self.attn2 = WanAttention(
            dim=dim,
            heads=heads,
            dim_head=dim // heads,
            eps=cfg.eps,
            cross_attention_dim_head=dim // heads,
            processor=WanAttnProcessor(),
        )
        self.norm2 = (
            FP32LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        )
        self.ffn = FeedForward(dim, inner_dim=cfg.ffn_dim, activation_fn="gelu-approximate")
        self.norm3 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        has_action = cfg.action is not None and index < cfg.action.blocks
        self.action: ActionModule | None = None
        self.action_model: MGActionModule | None = None  # the original's name, so its keys load
        if has_action and cfg.action.kind == "matrix-game":
            self.action_model = MGActionModule(cfg.action.mg)
        elif has_action:
            self.action = ActionModule(dim, cfg.action, cfg.eps)
        self.n_action_layers = min(cfg.action.blocks, cfg.num_layers) if cfg.action is not None else 0

    def text_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention K/V (..., L_text, heads, head_dim) for projected text tokens (..., L_text, dim)."""
        k = self.attn2.norm_k(self.attn2.to_k(context)).unflatten(-1, (self.heads, -1))
        v = self.attn2.to_v(context).unflatten(-1, (self.heads, -1))
        return k, v

    def forward(
        self, x: torch.Tensor, mod: torch.Tensor, layer: int, attn: Attention, actions: torch.Tensor | None
    ) -> torch.Tensor:
        """x (B, L, dim); mod (B, L or 1, 6, dim) timestep projection."""
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + mod.float()).unbind(2)

        # 1. self-attention (block-causal; through the pool in chunk mode)
        h = (self.norm1(x.float()) * (1 + scale) + shift).type_as(x)
        a = self.attn1
        q = a.norm_q(a.to_q(h)).unflatten(2, (self.heads, -1))  # (B, L, heads, hd)
        k = a.norm_k(a.to_k(h)).unflatten(2, (self.heads, -1))
        v = a.to_v(h).unflatten(2, (self.heads, -1))
        q, k = apply_rope(q, *attn.rope), apply_rope(k, *attn.rope)
        o = attn.self_attn(layer, q, k, v)
        o = a.to_out[0](o.flatten(2, 3).type_as(q))
        x = (x.float() + o * gate).type_as(x)

        # 2. cross-attention to the session's text (K/V precomputed per session). One text token
        # (a world without prompts): every query reads its V, so no query is computed.
        b2 = self.attn2
        o = attn.one_text_value(layer)
        if o is None:
            h = self.norm2(x.float()).type_as(x)
            q = b2.norm_q(b2.to_q(h)).unflatten(2, (self.heads, -1))
            o = attn.cross_attn(layer, q)
        else:
            o = o.expand(-1, x.shape[1], -1, -1)
        x = x + b2.to_out[0](o.flatten(2, 3).type_as(x))

        # 3. actions (on the raw residual stream)
        if self.action is not None and actions is not None:
            x = self.action(x, actions, layer, attn)
        elif self.action_model is not None and actions is not None:
            # actions: (B, n, pad, width) windows; keyboard K/V: this layer's per-frame pool buffers
            pool = getattr(attn, "pool", None)
            kb = (pool.kb_k[0][:, layer], pool.kb_v[0][:, layer]) if pool is not None else (None, None)
            x = forward_pooled(self.action_model, x, actions, attn.motion_rope, attn, layer, kb)

        # 4. feed-forward
        h = (self.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + self.ffn(h).float() * c_gate).type_as(x)


# --- the model ---------------------------------------------------------------------------------


class CausalWan(nn.Module):
    """The causal Wan DiT. Weight names follow diffusers' `WanTransformer3DModel`."""

    def __init__(self, cfg: CausalWanConfig, features: InputFeatures | None = None) -> None:
        """`features`: the `InputFeatures` that `cfg.input_features` names (built by
        models/registry.py from the config), None when it names none."""
        super().__init__()
        if (cfg.input_features is None) != (features is None):
            raise ValueError("cfg.input_features and `features` come together: pass the features it names")
        if cfg.patch_size[0] != 1:
            raise ValueError("causal rollout caches whole latent frames: patch_size[0] must be 1")
        if cfg.chunk_frames > cfg.window_frames:
            raise ValueError("window_frames must hold at least one chunk")
        self.cfg = cfg
        dim = cfg.dim
        self.input_features = features
        extra = features.channels if features is not None else 0
        self.patch_embedding = nn.Conv3d(
            cfg.in_channels + extra, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.condition_embedder = WanTimeTextImageEmbedding(
            dim=dim,
            time_freq_dim=cfg.freq_dim,
            time_proj_dim=dim * 6,
            text_embed_dim=cfg.text_dim,
            image_embed_dim=cfg.image_dim,
        )
        if cfg.image_dim:  # I2V: cross-attention reads only the projected image tokens (no text)
            self.condition_embedder.text_embedder = None
        self.blocks = nn.ModuleList([CausalWanBlock(cfg, i) for i in range(cfg.num_layers)])
        # Action modules sit in the leading blocks, so a block's index is its action-cache layer.
        self.n_action_layers = sum(
            blk.action is not None or blk.action_model is not None for blk in self.blocks
        )
        self.norm_out = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.pool: KVPool | None = None  # set by setup_caches
        self._spatial_rope: tuple[int, int, torch.Tensor, torch.Tensor] | None = None  # (h, w, cos, sin)

    # -- the K/V pool ---------------------------------------------------------------------------

    def tokens_per_frame(self, h: int, w: int) -> int:
        """Tokens of one latent frame of size (h, w)."""
        return self.cfg.tokens_per_frame(h, w)

    @property
    def _motion_heads(self) -> tuple[int, int] | None:
        """(heads, head_dim) of the action K/V, None when the model keeps none."""
        if not self.n_action_layers:
            return None
        a = self.cfg.action
        if a.kind == "matrix-game":
            return (a.mg.heads_num, 64) if a.kv_sets else None
        return self.blocks[0].action.motion_heads if self.blocks[0].action.motion_width > 0 else None

    def setup_caches(
        self,
        max_sessions: int,
        h: int,
        w: int,
        text_tokens: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        slack_frames: int = 0,
    ) -> KVPool:
        """Preallocate the K/V pool: `max_sessions` rows at latent size (h, w), each with (sink +
        window + `slack_frames`) frame slots and `text_tokens` (default `cfg.text_tokens`) text
        K/V slots. Slack is room for a second chunk in flight (runtime/kv_cache.py)."""
        cfg = self.cfg
        p = next(self.parameters())
        capacity = (cfg.sink_frames + cfg.window_frames + slack_frames) * self.tokens_per_frame(h, w)
        motion = self._motion_heads
        a_heads, a_hd = motion if motion else (1, 1)
        self.pool = KVPool(
            max_sessions,
            cfg.num_layers,
            capacity,
            cfg.num_attention_heads,
            cfg.attention_head_dim,
            text_tokens or cfg.text_tokens,
            self.n_action_layers * cfg.action.kv_sets if motion else 0,
            a_heads,
            a_hd,
            dtype=dtype or p.dtype,
            device=device or p.device,
            extras=cfg.row_extras(h * w, slack_frames),
        )
        ph, pw = cfg.patch_size[1:]
        cos, sin = spatial_rope(cfg.attention_head_dim, h // ph, w // pw, device=device or p.device)
        self._spatial_rope = (h // ph, w // pw, cos, sin)
        return self.pool

    def null_text(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The text embedding of a session without a prompt: zeros (null_text_len, text_dim)."""
        return torch.zeros(self.cfg.null_text_len, self.cfg.text_dim, device=device, dtype=dtype)

    def text_kv(self, text: torch.Tensor) -> TextKV:
        """Every layer's cross-attention K/V for text embeddings (L_text, text_dim), or for an I2V
        model image tokens (L_image, image_dim) through its image embedder."""
        ce = self.condition_embedder
        ctx = ce.image_embedder(text) if self.cfg.image_dim else ce.text_embedder(text)
        out = TextKV()
        for blk in self.blocks:
            k, v = blk.text_kv(ctx)
            out.k.append(k)
            out.v.append(v)
        return out

    def set_text(self, row: int, text: torch.Tensor) -> None:
        """Store the cross-attention K/V of text embeddings (L_text, text_dim) in pool row `row`."""
        self.set_text_kv(row, self.text_kv(text))

    def set_text_kv(self, row: int, kv: TextKV) -> None:
        """Store cross-attention K/V computed before (`text_kv`) in pool row `row` (a copy)."""
        self._pool().set_text(row, kv.k, kv.v)

    @torch.no_grad()
    def set_image_cond(self, row: int, cond: torch.Tensor) -> None:
        """Store an I2V session's conditioning latents (in - out channels, F, h, w) in pool row
        `row`: its first `cond_frames` frames (a shorter one repeats its last frame)."""
        buf = self._pool().cond[0, row]  # (C, cond_frames, h*w)
        c, f = buf.shape[:2]
        if cond.shape[0] != c:
            raise ValueError(f"conditioning has {cond.shape[0]} channels, the model takes {c}")
        idx = torch.arange(f, device=cond.device).clamp(max=cond.shape[1] - 1)
        buf.copy_(cond.index_select(1, idx).flatten(2).to(buf))

    def _pool(self) -> KVPool:
        if self.pool is None:
            raise RuntimeError("call setup_caches() before running chunks")
        return self.pool

    # -- forwards -------------------------------------------------------------------------------

    def _time(self, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Timestep embedding exactly as diffusers: temb (*, dim) and its 6-way projection (*, 6, dim)."""
        ce = self.condition_embedder
        shape = t.shape
        proj = ce.timesteps_proj(t.flatten())
        emb_dtype = next(iter(ce.time_embedder.parameters())).dtype
        temb = ce.time_embedder(proj.to(emb_dtype)).to(dtype)
        tproj = ce.time_proj(ce.act_fn(temb))
        return temb.unflatten(0, shape), tproj.unflatten(0, shape).unflatten(-1, (6, -1))

    def _embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        if self.input_features is not None:
            x = torch.cat([x, self.input_features(x)], dim=1)
        p = self.cfg.patch_size
        grid = (x.shape[2] // p[0], x.shape[3] // p[1], x.shape[4] // p[2])
        return self.patch_embedding(x).flatten(2).transpose(1, 2).contiguous(), grid

    def _head(self, x: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        shift, scale = (self.scale_shift_table + temb.unsqueeze(-2)).unbind(-2)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)
        b = x.shape[0]
        f, hh, ww = grid
        pt, ph, pw = self.cfg.patch_size
        x = x.reshape(b, f, hh, ww, pt, ph, pw, -1)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, F, pt, H, ph, W, pw)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def _ropes(
        self, frame_pos: torch.Tensor, grid: tuple[int, int, int]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
        """Once per forward: the 3D RoPE tables and the action module's frame RoPE."""
        _, hh, ww = grid
        cached = self._spatial_rope
        spatial = cached[2:] if cached is not None and cached[:2] == (hh, ww) else None
        rope = rope_3d(self.cfg.attention_head_dim, frame_pos, hh, ww, spatial=spatial)
        if self._mg:  # mouse and keyboard share the action RoPE
            return rope, rope_tables(self.cfg.action.mg, frame_pos, hh * ww)
        motion = self._motion_heads
        if motion is None:
            return rope, None
        return rope, frame_rope(motion[1], frame_pos, hh * ww, self.cfg.action.rope_theta)

    def forward_chunk(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        index: ChunkIndex,
        actions: torch.Tensor | None = None,
        need_output: bool = True,
    ) -> torch.Tensor | None:
        """One chunk per batch entry: x (B, C, n, H, W) at timesteps t (B,) -> prediction (B, C, n, H, W).

        Writes the chunk's K/V into each entry's pool row at `index.write` and attends over the
        row's slots marked in `index.valid`. `actions` (B, n, frames_per_latent, width) or None. An I2V
        model takes x with its out_channels noise channels and appends each row's conditioning
        frames (`set_image_cond`); x with all in_channels is used as given. With
        `need_output=False` (the clean context pass) the output head is skipped. Shapes depend
        only on B, and nothing here reads a device value on the host.
        """
        n = x.shape[2]
        frame_pos = index.frame_offset[:, None] + torch.arange(n, device=x.device)  # (B, n)
        pool = self._pool()
        if x.shape[1] < self.cfg.in_channels:  # I2V: each row's conditioning frames (from its pool row)
            fidx = frame_pos.clamp(max=pool.cond.shape[3] - 1)
            cond = pool.cond[0].index_select(0, index.rows)  # (B, C, cond_frames, h*w)
            cond = torch.gather(cond, 2, fidx[:, None, :, None].expand(-1, cond.shape[1], -1, cond.shape[3]))
            x = torch.cat([x, cond.unflatten(3, x.shape[3:]).to(x.dtype)], dim=1)
        if actions is not None and self._mg:
            actions = self._mg_windows_chunk(actions, index, frame_pos)
        tokens, grid = self._embed(x)
        rope, motion_rope = self._ropes(frame_pos, grid)
        temb, tproj = self._time(t, x.dtype)
        mod = tproj[:, None]  # (B, 1, 6, dim)
        attn = PoolAttention(pool, index, grid[1] * grid[2], rope, motion_rope)
        for i, blk in enumerate(self.blocks):
            tokens = blk(tokens, mod, i, attn, actions)
        if not need_output:
            return None
        return self._head(tokens, temb[:, None], grid)

    @property
    def _mg(self) -> bool:
        """Whether the action module is Matrix-Game's (its actions arrive raw and are windowed here)."""
        return self.cfg.action is not None and self.cfg.action.kind == "matrix-game"

    def _mg_columns(self, actions: torch.Tensor) -> torch.Tensor:
        """Protocol action columns [keys | dx, dy | ...] -> the original's [keys | pitch, yaw]."""
        a = self.cfg.action
        kd = a.mg.keyboard_dim_in
        dx, dy = actions[..., kd], actions[..., kd + 1]
        mouse = torch.stack([-dy, dx], dim=-1) * a.mouse_scale
        return torch.cat([actions[..., :kd], mouse], dim=-1)

    def _mg_windows_chunk(
        self, actions: torch.Tensor, index: ChunkIndex, frame_pos: torch.Tensor
    ) -> torch.Tensor:
        """Write each entry's raw chunk actions (B, n, ratio, width) into its row's action ring
        (at absolute raw positions, so a rolled-back chunk's writes are simply overwritten by the
        next try, like scratch K/V) and read every latent frame's window (B, n, pad, K + 2)."""
        mg = self.cfg.action.mg
        ring = self._pool().act_ring[0]  # (rows + 1, R, K + 2)
        raw = self._mg_columns(actions).flatten(1, 2)  # (B, n*ratio, K + 2)
        start = mg.vae_time_compression_ratio * index.frame_offset[:, None]
        pos = start + torch.arange(raw.shape[1], device=raw.device)
        ring.index_put_((index.rows[:, None], pos % ring.shape[1]), raw.to(ring.dtype))
        return ring_windows(ring.index_select(0, index.rows), frame_pos, mg)

    def forward_dense(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        text: Sequence[TextKV],
        frame_mask: torch.Tensor,
        actions: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Whole clips: x (B, C, F, H, W), one timestep per frame t (B, F), frame mask (F, F) bool.

        `positions` (F,) int64 gives each frame's RoPE frame index (default 0..F-1). Repeated
        indices let one sequence hold two copies of a frame, e.g. a clean context copy and a
        noisy copy for teacher-forced training (CausVid); the mask decides who sees whom.
        Every clip's text must have the same length. An I2V model takes x with all its
        in_channels (noise + conditioning) here.
        """
        tokens, grid = self._embed(x)
        b, tpf = x.shape[0], grid[1] * grid[2]
        if positions is None:
            positions = torch.arange(grid[0], device=x.device)
        frame_pos = positions.to(x.device)[None].expand(b, -1)
        rope, motion_rope = self._ropes(frame_pos, grid)
        if actions is not None and self._mg:  # the clip is the whole ring
            actions = ring_windows(self._mg_columns(actions).flatten(1, 2), frame_pos, self.cfg.action.mg)
        temb, tproj = self._time(t, x.dtype)  # (B, F, dim), (B, F, 6, dim)
        temb = temb.repeat_interleave(tpf, dim=1)
        mod = tproj.repeat_interleave(tpf, dim=1)
        layers = range(len(self.blocks))
        text_k = [torch.stack([tk.k[i] for tk in text]) for i in layers]
        text_v = [torch.stack([tk.v[i] for tk in text]) for i in layers]
        attn = DenseAttention(frame_mask, tpf, text_k, text_v, rope, motion_rope)
        for i, blk in enumerate(self.blocks):
            tokens = blk(tokens, mod, i, attn, actions)
        return self._head(tokens, temb, grid)

"""Matrix-Game 2.0's action module, weight-compatible with its checkpoints (``blocks.N.action_model.*``).

Written from the behaviour of the original (SkyworkAI/Matrix-Game, Matrix-Game-2/wan/modules/
action_module.py; read, not copied) and checked against it by the golden fixtures in
tests/fixtures/golden/. Parameter names are the original's, so a converted checkpoint loads key
for key (the four q/k RMSNorm weights the original stores but never multiplies are dropped by the
converter: its RMSNorm forward ignores them).

What one call does to hidden states x (B, T*S, C) of T latent frames of S tokens each:

* mouse (when enabled): each token's hidden state, concatenated with the mouse deltas of its
  frame's action window, goes through an MLP; self-attention then runs along the frame axis at
  every spatial position (q/k RMS-normalised, RoPE on the first 8 of 64 head dims, theta 256)
  against this module's own frame cache; the projection is added to x.
* keyboard (when enabled): the key states of the window are embedded (Linear, SiLU, Linear) and
  flattened into one K/V token per latent frame; every token of x cross-attends along the frame
  axis to those tokens (same norms and RoPE) through a second cache; the projection is added.

Action windows: latent frame f sees raw (video-rate) action frames ``4f-12 .. 4f-1``
(``ratio * (f - window) .. ratio * f - 1``), front-padded with copies of raw frame 0. The caches
hold the last ``local_attn_size`` latent frames (the current chunk included); writing a frame
again (the next denoising step or the context pass) overwrites it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from models.kv_pool import DenseAttention, PoolAttention

HEAD_DIM = 64  # the original's RoPE table is built for 64-dim heads (8 + 28 + 28)


@dataclass
class MGActionConfig:
    """The original ``action_config`` (configs/distilled_model/*/config.json) plus the window."""

    keyboard_dim_in: int = 4
    mouse_dim_in: int = 2
    enable_keyboard: bool = True
    enable_mouse: bool = True
    hidden_size: int = 128  # keyboard embedding width
    img_hidden_size: int = 1536  # the DiT width
    keyboard_hidden_dim: int = 1024
    mouse_hidden_dim: int = 1024
    vae_time_compression_ratio: int = 4  # raw action frames per latent frame
    windows_size: int = 3  # latent frames of actions each latent frame sees
    heads_num: int = 16
    qkv_bias: bool = False
    rope_dim_list: tuple[int, ...] = (8, 28, 28)  # only the first part rotates (the others see position 0)
    rope_theta: float = 256.0
    local_attn_size: int = 6  # latent frames the action caches keep (the model's local window)
    blocks: tuple[int, ...] = tuple(range(15))  # DiT blocks that carry the module
    eps: float = 1e-6

    def __post_init__(self) -> None:
        parts = (
            (self.enable_keyboard, self.keyboard_hidden_dim, "keyboard"),
            (self.enable_mouse, self.mouse_hidden_dim, "mouse"),
        )
        for enabled, width, what in parts:
            if enabled and width != self.heads_num * HEAD_DIM:
                raise ValueError(f"{what}_hidden_dim {width} must be heads_num * {HEAD_DIM}")
        if sum(self.rope_dim_list) != HEAD_DIM:
            raise ValueError(f"rope_dim_list {self.rope_dim_list} must sum to {HEAD_DIM}")

    @property
    def pad(self) -> int:
        """Raw action frames in one window."""
        return self.vae_time_compression_ratio * self.windows_size

    @classmethod
    def from_original(cls, action_config: dict, local_attn_size: int) -> MGActionConfig:
        """From the original config's ``action_config`` dict (unknown keys such as patch_size ignored)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in action_config.items() if k in names}
        for key in ("rope_dim_list", "blocks"):
            if key in kw:
                kw[key] = tuple(kw[key])
        return cls(**kw, local_attn_size=local_attn_size)

    def to_dict(self) -> dict:
        """JSON-ready dict (round-trips through `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MGActionConfig:
        """Inverse of `to_dict`."""
        kw = dict(data)
        for key in ("rope_dim_list", "blocks"):
            if key in kw:
                kw[key] = tuple(kw[key])
        return cls(**kw)


@dataclass
class MGActionCache:
    """One session's action K/V for one block: latent frame index -> post-RoPE K, V.

    Holds at most ``local_attn_size`` frames (older ones are dropped on write)."""

    limit: int
    mouse: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # (B*S, H, D) each
    keyboard: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # (B, H, D) each

    def write(
        self, which: str, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store frames [start, start + n) of k, v (N, n, H, D); return the attended (N, <=limit, H, D)."""
        store = getattr(self, which)
        n = k.shape[1]
        for i in range(n):
            store[start + i] = (k[:, i], v[:, i])
        end = start + n
        for f in [f for f in store if f < end - self.limit or f >= end]:
            del store[f]  # frames past `end` belong to a rolled-back future; never attended again
        frames = sorted(store)
        return (
            torch.stack([store[f][0] for f in frames], dim=1),
            torch.stack([store[f][1] for f in frames], dim=1),
        )


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The original's action RMSNorm: no weight, no float upcast."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, start: int, rot_dim: int, theta: float) -> torch.Tensor:
    """Rotate interleaved pairs of the first `rot_dim` head dims of x (N, T, H, D) by frame position."""
    t = x.shape[1]
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, device=x.device)[: rot_dim // 2].float() / rot_dim))
    pos = torch.arange(start, start + t, device=x.device, dtype=torch.float32)
    ang = torch.outer(pos, inv)  # (T, rot/2)
    cos = ang.cos().repeat_interleave(2, dim=1)[None, :, None, :]
    sin = ang.sin().repeat_interleave(2, dim=1)[None, :, None, :]
    xf = x.float()
    head = xf[..., :rot_dim]
    re, im = head.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-im, re], dim=-1).flatten(-2)
    return torch.cat([head * cos + rotated * sin, xf[..., rot_dim:]], dim=-1).type_as(x)


def window_actions(raw: torch.Tensor, start_frame: int, frames: int, ratio: int, window: int) -> torch.Tensor:
    """Action windows of latent frames [start_frame, start_frame + frames): (B, frames, ratio*window, C).

    `raw` (B, R, C) holds raw action frames 0..R-1 (R >= ratio * (start_frame + frames - 1));
    frame f's window is raw ``ratio*(f-window) .. ratio*f - 1``, indices below 0 reading frame 0.
    """
    need = ratio * (start_frame + frames - 1)
    if raw.shape[1] < max(need, 1):
        raise ValueError(
            f"actions cover {raw.shape[1]} raw frames; latent frame {start_frame + frames - 1} needs {need}"
        )
    idx = torch.arange(ratio * window, device=raw.device)
    rows = torch.stack([ratio * (f - window) + idx for f in range(start_frame, start_frame + frames)])
    return raw[:, rows.clamp(min=0)]  # (B, frames, ratio*window, C)


class MGActionModule(nn.Module):
    """The action module of one Matrix-Game 2.0 block (original parameter names)."""

    def __init__(self, cfg: MGActionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg.img_hidden_size
        if cfg.enable_keyboard:
            h = cfg.hidden_size
            self.keyboard_embed = nn.Sequential(nn.Linear(cfg.keyboard_dim_in, h), nn.SiLU(), nn.Linear(h, h))
            self.mouse_attn_q = nn.Linear(c, cfg.keyboard_hidden_dim, bias=cfg.qkv_bias)
            self.keyboard_attn_kv = nn.Linear(h * cfg.pad, 2 * cfg.keyboard_hidden_dim, bias=cfg.qkv_bias)
            self.proj_keyboard = nn.Linear(cfg.keyboard_hidden_dim, c, bias=cfg.qkv_bias)
        if cfg.enable_mouse:
            m = cfg.mouse_hidden_dim
            self.mouse_mlp = nn.Sequential(
                nn.Linear(cfg.mouse_dim_in * cfg.pad + c, m),
                nn.GELU(approximate="tanh"),
                nn.Linear(m, m),
                nn.LayerNorm(m),
            )
            self.t_qkv = nn.Linear(m, 3 * m, bias=cfg.qkv_bias)
            self.proj_mouse = nn.Linear(m, c, bias=cfg.qkv_bias)

    def new_cache(self) -> MGActionCache:
        """An empty cache for one session."""
        return MGActionCache(self.cfg.local_attn_size)

    def forward(
        self,
        x: torch.Tensor,
        grid: tuple[int, int, int],
        start_frame: int,
        cache: MGActionCache,
        keyboard: torch.Tensor | None = None,
        mouse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T*S, C) for latent frames [start_frame, start_frame + T) of grid (T, h, w);
        keyboard (B, R, keyboard_dim_in) and mouse (B, R, mouse_dim_in) raw action frames from 0
        (see `window_actions`). Returns x plus the action signal."""
        cfg = self.cfg
        b, _, c = x.shape
        t, s = grid[0], grid[1] * grid[2]
        if cfg.enable_mouse and mouse is not None:
            x = x + self._mouse(x, mouse, start_frame, cache, b, t, s, c)
        if cfg.enable_keyboard and keyboard is not None:
            x = x + self._keyboard(x, keyboard, start_frame, cache, b, t, s)
        return x

    def _mouse(self, x, mouse, start, cache, b, t, s, c) -> torch.Tensor:
        cfg = self.cfg
        heads = cfg.heads_num
        hs = x.view(b, t, s, c).transpose(1, 2).reshape(b * s, t, c)
        win = window_actions(mouse, start, t, cfg.vae_time_compression_ratio, cfg.windows_size).to(x.dtype)
        win = win.flatten(2)[:, None].expand(b, s, t, -1).reshape(b * s, t, -1)
        m = self.mouse_mlp(torch.cat([hs, win], dim=-1))
        q, k, v = self.t_qkv(m).view(b * s, t, 3, heads, HEAD_DIM).unbind(2)
        q, k = _rms(q, cfg.eps).to(v), _rms(k, cfg.eps).to(v)
        rot = cfg.rope_dim_list[0]
        q, k = _rope(q, start, rot, cfg.rope_theta), _rope(k, start, rot, cfg.rope_theta)
        kk, vv = cache.write("mouse", start, k, v)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2))
        o = o.transpose(1, 2).reshape(b, s, t, heads * HEAD_DIM).transpose(1, 2).reshape(b, t * s, -1)
        return self.proj_mouse(o)

    def _keyboard(self, x, keyboard, start, cache, b, t, s) -> torch.Tensor:
        cfg = self.cfg
        heads = cfg.heads_num
        emb = self.keyboard_embed(keyboard.to(x.dtype))
        win = window_actions(emb, start, t, cfg.vae_time_compression_ratio, cfg.windows_size).flatten(2)
        q = self.mouse_attn_q(x).view(b, t * s, heads, HEAD_DIM)
        k, v = self.keyboard_attn_kv(win).view(b, t, 2, heads, HEAD_DIM).unbind(2)
        q, k = _rms(q, cfg.eps).to(v), _rms(k, cfg.eps).to(v)
        q = q.view(b, t, s, heads, HEAD_DIM).transpose(1, 2).reshape(b * s, t, heads, HEAD_DIM)
        rot = cfg.rope_dim_list[0]
        q, k = _rope(q, start, rot, cfg.rope_theta), _rope(k, start, rot, cfg.rope_theta)
        kk, vv = cache.write("keyboard", start, k, v)  # (B, F, H, D): one K/V token per latent frame
        kk = kk.repeat_interleave(s, dim=0)
        vv = vv.repeat_interleave(s, dim=0)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2))
        o = o.transpose(1, 2).reshape(b, s, t, heads * HEAD_DIM).transpose(1, 2).reshape(b, t * s, -1)
        return self.proj_keyboard(o)


# --- the served path: batched over sessions, K/V in the model's pool --------------------------


def rope_tables(
    cfg: MGActionConfig, frame_pos: torch.Tensor, tokens_per_frame: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, n*T, 1, 64) of the action RoPE for latent frames `frame_pos` (B, n): the first
    ``rope_dim_list[0]`` head dims rotate by frame (theta ``rope_theta``), the rest stay put."""
    rot = cfg.rope_dim_list[0]
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, device=frame_pos.device).float() / rot))
    ang = frame_pos.float()[..., None] * inv  # (B, n, rot/2)
    b, n = frame_pos.shape
    rest = HEAD_DIM - rot
    cos = torch.cat([ang.cos().repeat_interleave(2, -1), ang.new_ones(b, n, rest)], dim=-1)
    sin = torch.cat([ang.sin().repeat_interleave(2, -1), ang.new_zeros(b, n, rest)], dim=-1)
    t = tokens_per_frame
    return cos.repeat_interleave(t, dim=1)[:, :, None], sin.repeat_interleave(t, dim=1)[:, :, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (B, L, H, D) by tables (B, L, 1, D) (as `_rope`)."""
    re, im = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([re * c - im * s, im * c + re * s], dim=-1).flatten(-2).type_as(x)


def ring_windows(ring: torch.Tensor, frame_pos: torch.Tensor, cfg: MGActionConfig) -> torch.Tensor:
    """Action windows (B, n, pad, W) of latent frames `frame_pos` (B, n) from per-entry rings
    (B, R, W) of raw action frames stored at ``k mod R``.

    Raw action ``k`` is entry ``j`` of latent frame ``f``'s group of ``ratio`` (``k = ratio*f + j``;
    the first latent frame's group repeats raw frame 0). The original's raw frame ``r`` is
    ``k - (ratio - 1)``, so its window ``ratio*(f - window) .. ratio*f - 1`` is
    ``k = ratio*(f - window) + ratio - 1 ...``, and indices below 0 read frame 0 (k = 0)."""
    ratio = cfg.vae_time_compression_ratio
    offs = torch.arange(cfg.pad, device=frame_pos.device) + ratio * (1 - cfg.windows_size) - 1
    k = (ratio * frame_pos[..., None] + offs).clamp(min=0) % ring.shape[1]  # (B, n, pad)
    return torch.gather(
        ring[:, None].expand(-1, k.shape[1], -1, -1), 2, k[..., None].expand(-1, -1, -1, ring.shape[-1])
    )


def forward_pooled(
    module: MGActionModule,
    x: torch.Tensor,
    windows: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    attn: PoolAttention | DenseAttention,
    layer: int,
    keyboard_kv: tuple[torch.Tensor, torch.Tensor] | tuple[None, None],
) -> torch.Tensor:
    """The module over a batch of chunks: x (B, n*T, C) residual stream, `windows` (B, n, pad,
    keyboard_dim_in + 2) raw action windows ``[keys | pitch, yaw]``, `rope` from `rope_tables`.

    The mouse's temporal K/V go through `attn.motion_attn` (the pool's action K/V of `layer`:
    attention along frames at every spatial position); the keyboard's one K/V token per latent
    frame goes through `attn.frame_attn` into the per-frame buffers `keyboard_kv` (this layer's
    slice of the pool's `kb_k`, `kb_v`; None in the dense forward)."""
    cfg = module.cfg
    b, nt, _ = x.shape
    t = attn.tokens_per_frame
    n = nt // t
    heads, kd = cfg.heads_num, cfg.keyboard_dim_in
    cos, sin = rope
    if cfg.enable_mouse:
        mouse = windows[..., kd : kd + cfg.mouse_dim_in].flatten(2).to(x.dtype)  # (B, n, pad*2)
        m = module.mouse_mlp(torch.cat([x, mouse.repeat_interleave(t, dim=1)], dim=-1))
        q, k, v = module.t_qkv(m).view(b, nt, 3, heads, HEAD_DIM).unbind(2)
        q, k = _rms(q, cfg.eps).to(v), _rms(k, cfg.eps).to(v)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + module.proj_mouse(attn.motion_attn(layer, q, k, v))
    if cfg.enable_keyboard:
        emb = module.keyboard_embed(windows[..., :kd].to(x.dtype)).flatten(2)  # (B, n, pad*hidden)
        k, v = module.keyboard_attn_kv(emb).view(b, n, 2, heads, HEAD_DIM).unbind(2)
        q = module.mouse_attn_q(x).view(b, nt, heads, HEAD_DIM)
        q, k = _rms(q, cfg.eps).to(v), _rms(k, cfg.eps).to(v)
        q, k = _rotate(q, cos, sin), _rotate(k, cos[:, ::t], sin[:, ::t])  # k: one position per frame
        x = x + module.proj_keyboard(attn.frame_attn(*keyboard_kv, q, k, v))
    return x

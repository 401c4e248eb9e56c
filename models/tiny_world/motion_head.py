"""A learned motion head: how the view and the player move in the next chunk, under its keys.

A world model has to say where the camera goes when a key is held: how fast, where a wall stops
the player, where the world ends and the camera stops while the player walks on, that opposite
keys cancel and that space moves nothing. The tiny world's DiT draws terrain well but learned
none of that reliably (MODEL_CARD.md, "Experiments"); until issue 41 a hand-written plan (the
game's rule: one pixel a frame, the camera follows a centred player while it has room) did it.
This head learns it from the recorded episodes instead, as a small supervised network:

* a trunk reads the session's latest latent frame and the sprite marker (where the player is
  relative to each cell, `models.tiny_world.marker`): a few 3x3 convolutions, then two learned
  attention pools over the cells (one learns to look next to the player, one at the view's
  border);
* for each frame of the chunk in turn, a small MLP reads the pooled features, that frame's keys
  and how far the view and the player have moved so far in the chunk, and predicts the view's
  and the player's move on each axis (classes -max_step..max_step px) and, per key, whether it
  had any effect (a key the world ignores, such as one held against a wall, is released before
  the DiT sees it, so the DiT draws a pressed player as it was trained to).

Nothing of the game is written here: the keys' directions, the speed, walls, the camera's clamp
and the cancelling of opposite keys are all in the weights. Zeroed, the head predicts no motion
(the expected move of a uniform distribution over symmetric classes) and releases no key.

The sampler pins the planned motion into the view's phase and the player's place channels of
every clean estimate (`MotionHead.steer`, `models.tiny_world.plugin.Pins`), so the DiT draws the
terrain and the creatures around it; the atlas (`models.tiny_world.atlas`) files and recalls
tiles by the same planned phases: the head's predicted pose is the memory's address.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.tiny_world.fast_decoder import phase_channels
from models.tiny_world.marker import MarkerConfig, marker_inputs, marker_motion, sprite_marker


@dataclass
class MotionHeadConfig:
    """What a motion head reads and predicts (worldserve.json "plugin.motion")."""

    keys: tuple[str, ...]  # the action rows' key columns, in order (the world's action space)
    in_channels: int  # latent channels
    marker: MarkerConfig  # the latents' sprite marker (the view's phase, the player's place)
    horizon: int = 4  # frames one plan covers (a chunk)
    width: int = 48  # convolution channels
    layers: int = 4  # 3x3 convolutions
    hidden: int = 128  # the per-frame MLP's width
    max_step: int = 2  # px a frame the head can move the view or the player per axis (its classes)

    def __post_init__(self) -> None:
        if self.horizon < 1 or self.layers < 1 or self.max_step < 1:
            raise ValueError("a motion head needs horizon, layers and max_step >= 1")

    @property
    def classes(self) -> int:
        """Move classes per axis: -max_step..max_step px."""
        return 2 * self.max_step + 1

    def to_dict(self) -> dict:
        """JSON-ready."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MotionHeadConfig:
        """Inverse of `to_dict`."""
        data = dict(data)
        data["keys"] = tuple(data["keys"])
        mk = dict(data["marker"])
        mk["mean"], mk["std"] = tuple(mk["mean"]), tuple(mk["std"])
        data["marker"] = MarkerConfig(**mk)
        return cls(**data)


@dataclass
class MotionPlan:
    """One chunk's predicted motion (`MotionHead.roll`)."""

    view: torch.Tensor  # (B, 2, n) px the view moved since the chunk's start, x then y, per frame
    place: torch.Tensor  # (B, 2, n) px the player moved in the view since the chunk's start
    effective: torch.Tensor  # (B, n, keys) bool: the key, held, does something in that frame


class MotionHead(nn.Module):
    """Latest latent frame (B, C, h, w) + a chunk's keys (B, n, keys) -> the chunk's motion."""

    def __init__(self, cfg: MotionHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        chans = [cfg.in_channels + MarkerConfig.channels] + [cfg.width] * cfg.layers
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in itertools.pairwise(chans))
        self.pools = nn.Conv2d(cfg.width, 2, 1)  # two attention maps over the cells
        k = len(cfg.keys)
        self.step_in = nn.Linear(2 * cfg.width + k + 4 + 2, cfg.hidden)
        self.step_mid = nn.Linear(cfg.hidden, cfg.hidden)
        self.step_out = nn.Linear(cfg.hidden, 4 * cfg.classes + k)

    def context(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z (B, C, h, w) normalised latents -> pooled features (B, 2 * width) and the player's
        place in the view (B, 2) px, read from the sprite channels."""
        marker = sprite_marker(z[:, :, None], self.cfg.marker)[:, :, 0]
        x = torch.cat([z, marker], dim=1)
        for conv in self.convs:
            x = F.silu(conv(x))
        w = torch.softmax(self.pools(x).flatten(2), dim=2)  # (B, 2, h*w)
        pooled = torch.einsum("bcn,bpn->bpc", x.flatten(2), w).flatten(1)
        _, place = marker_motion(z[:, list(marker_inputs(self.cfg.marker))].mean(dim=(2, 3)), self.cfg.marker)
        return pooled, place

    def step(
        self,
        ctx: torch.Tensor,
        place: torch.Tensor,
        keys: torch.Tensor,
        view: torch.Tensor,
        own: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One frame: pooled features (B, F), the player's place at the chunk's start (B, 2) px,
        the frame's keys (B, keys) in 0..1, the view's and the player's moves so far (B, 2) px
        each -> logits of the view's move (B, 2, classes), the player's (B, 2, classes) and each
        key's effect (B, keys)."""
        s = self.cfg.marker.scale
        h = torch.cat([ctx, keys, view / s, own / s, (place + own) / s], dim=1)
        h = F.gelu(self.step_mid(F.gelu(self.step_in(h))))
        out = self.step_out(h)
        c = self.cfg.classes
        return out[:, : 2 * c].view(-1, 2, c), out[:, 2 * c : 4 * c].view(-1, 2, c), out[:, 4 * c :]

    def expected(self, logits: torch.Tensor) -> torch.Tensor:
        """Move logits (..., classes) -> the expected move, rounded to whole px."""
        m = self.cfg.max_step
        moves = torch.arange(-m, m + 1, dtype=logits.dtype, device=logits.device)
        return torch.round((torch.softmax(logits, dim=-1) * moves).sum(-1))

    @torch.no_grad()
    def roll(self, z: torch.Tensor, keys: torch.Tensor) -> MotionPlan:
        """The chunk's motion from the latest latent frames z (B, C, h, w) and keys (B, n, keys),
        frame by frame, each frame reading the moves the head predicted before it."""
        ctx, place = self.context(z)
        b, n = keys.shape[:2]
        view = place.new_zeros(b, 2)
        own = place.new_zeros(b, 2)
        views, owns, effective = [], [], []
        for f in range(n):
            lv, lp, le = self.step(ctx, place, keys[:, f].to(ctx.dtype), view, own)
            view, own = view + self.expected(lv), own + self.expected(lp)
            views.append(view)
            owns.append(own)
            effective.append(le >= 0)  # p >= 0.5: a tie keeps the key
        return MotionPlan(torch.stack(views, 2), torch.stack(owns, 2), torch.stack(effective, 1))

    @torch.no_grad()
    def steer(self, actions: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's action rows (B, n, ..., width) and the latest latent frames z (B, C, h, w) ->
        the rows with every held key the head finds without effect released, and the chunk's
        motion as pinned latents (B, 6, n): normalised values of the marker's channels
        (`marker_inputs`: the view's 4 phase channels, then the player's 2 place channels). The
        rows' first columns are the keys (`ActionSpace`); a key held in any row of a frame counts."""
        k = len(self.cfg.keys)
        rows = actions[..., :k]
        keys = rows.flatten(2, -2).amax(2) if actions.dim() > 3 else rows  # (B, n, keys)
        plan = self.roll(z, keys)
        release = (keys > 0.5) & ~plan.effective
        keep = (~release).to(actions.dtype).view(*release.shape[:2], *[1] * (actions.dim() - 3), k)
        out = actions.clone()
        out[..., :k] = rows * keep
        return out, self.pins(z, plan)

    def pins(self, z: torch.Tensor, plan: MotionPlan) -> torch.Tensor:
        """(B, 6, n) normalised marker-channel values of `plan` from the latest latent frames z."""
        mk = self.cfg.marker
        phase, place = marker_motion(z[:, list(marker_inputs(mk))].mean(dim=(2, 3)).float(), mk)
        phases = torch.round(phase)[:, :, None] + plan.view.float()  # (B, 2, n)
        places = torch.round(place)[:, :, None] + plan.place.float()
        b, n = phases.shape[0], phases.shape[2]
        cos_sin = phase_channels(phases.transpose(1, 2).reshape(b * n, 2), mk.spatial, (1, 1))
        raw = torch.cat([cos_sin.view(b, n, 4).transpose(1, 2), places / mk.scale], dim=1)
        mean = torch.tensor(mk.mean, dtype=raw.dtype, device=raw.device)[:, None]
        std = torch.tensor(mk.std, dtype=raw.dtype, device=raw.device)[:, None]
        return ((raw - mean) / std).to(z.dtype)

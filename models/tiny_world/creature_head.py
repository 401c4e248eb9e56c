"""A learned creature head: how the wandering creatures walk, and where new ones are met.

Why (issue 41): the autoencoder's creature layer (`FastAEConfig.creatures`: per cell, whether a
creature's square starts there and at which pixel) gave the creatures a representation, but the
DiT did not learn to move them (MODEL_CARD.md, "Creatures"): served, they stood where the session
first saw them, and none appeared in terrain the player walked into. This head learns both from
the recorded episodes, as a small supervised network beside the motion head:

* **walk**: a few 3x3 convolutions read the latest frame's terrain cells and the creature layers
  of the last `lags` frames (all on the latest frame's anchor; three frames, because at half a
  pixel a frame two cannot tell when a creature's next step comes) and predict, at every cell
  where a creature starts, its cumulative move into each frame of the chunk (classes
  -max_step..max_step px per axis). The head learns the speed, the diagonals and the bounce off
  walls from the recordings; the game's random turns it cannot know, so it walks straight on.
* **births**: a table fit on the training frames, per tile class of the autoencoder's codebook,
  of how often a creature's square starts in a tile of that class and where in it. A session
  meets a creature in a tile that comes into view for the first time (a tile the terrain prior
  draws, `models.tiny_world.atlas`) at that rate;
* **entries**: a map fit on the training episodes, per pixel of the canvas, of how often a
  creature's square that was off the canvas at a chunk's start starts there at its end (they
  walk in across its outer cells, which no view shows). A session draws them every chunk, so
  creatures keep coming into a view that stands still or walks where it has been; one that walks
  off the canvas is gone (one whose tile scrolls off it the session's atlas remembers:
  `Cartographer.file_creatures`).

The plug-in (`models.tiny_world.plugin`) writes the result into the creature channels of every
clean estimate, as it writes the motion head's plan. Nothing of the game is written here: speed,
directions, walls and the creatures' density are in the weights. Zeroed, the walk moves nothing
(the expected move of a uniform distribution), a creature is met in half the new tiles and one
walks into every outer cell of the canvas each chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.tiny_world.fast_decoder import creature_channels, read_creatures
from models.tiny_world.terrain_prior import uniform

BIRTH_SALT = 0x5EED  # added to a session's salt: creature draws never reuse the terrain's


@dataclass
class CreatureHeadConfig:
    """What a creature head reads and predicts (worldserve.json "plugin.creatures")."""

    cell_channels: int  # the latents' terrain channels (`FastAEConfig.cell_channels`)
    classes: int  # codebook entries (the tile classes births are tabled by)
    spatial: int = 8  # canvas pixels per cell
    horizon: int = 4  # frames one walk covers (a chunk)
    lags: int = 3  # frames of creature layers the walk reads (the latest last)
    max_step: int = 2  # px a creature can move per axis over `horizon` frames (the classes)
    canvas: int = 12  # cells per side of a latent frame's canvas (entries start in its outer ring)
    width: int = 48  # convolution channels
    layers: int = 3  # 3x3 convolutions

    def __post_init__(self) -> None:
        if min(self.horizon, self.lags, self.max_step, self.layers, self.classes) < 1:
            raise ValueError("a creature head needs horizon, lags, max_step, layers and classes >= 1")

    @property
    def moves(self) -> int:
        """Move classes per axis: -max_step..max_step px."""
        return 2 * self.max_step + 1

    def to_dict(self) -> dict:
        """JSON-ready."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CreatureHeadConfig:
        """Inverse of `to_dict`."""
        return cls(**data)


class CreatureHead(nn.Module):
    """Terrain cells + recent creature layers -> each creature's walk; tile classes -> births."""

    def __init__(self, cfg: CreatureHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        chans = [cfg.cell_channels + 3 * cfg.lags] + [cfg.width] * cfg.layers
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in itertools.pairwise(chans))
        self.out = nn.Conv2d(cfg.width, cfg.horizon * 2 * cfg.moves, 1)
        # Per tile class: the logit that a creature's square starts in such a tile, then the
        # logits of the pixel of the tile it starts at (s * s).
        self.births = nn.Parameter(torch.zeros(cfg.classes, 1 + cfg.spatial**2))
        # Per canvas pixel: the logit that a creature walks in during a chunk and starts there.
        self.entries = nn.Parameter(torch.zeros(cfg.canvas * cfg.spatial, cfg.canvas * cfg.spatial))

    def forward(self, cells: torch.Tensor, layers: torch.Tensor) -> torch.Tensor:
        """Normalised terrain cells (B, k, g, g) and raw creature layers (B, lags, 3, g, g), the
        latest last (`clean_layers`) -> move logits (B, horizon, 2, moves, g, g): at each cell,
        the cumulative move into each frame, x then y, of a creature that starts there."""
        x = torch.cat([cells, layers.flatten(1, 2)], dim=1)
        for conv in self.convs:
            x = F.silu(conv(x))
        b, _, g, _ = x.shape
        return self.out(x).view(b, self.cfg.horizon, 2, self.cfg.moves, g, g)

    def expected(self, logits: torch.Tensor, dim: int) -> torch.Tensor:
        """Move logits -> the expected move along `dim` (the classes), rounded to whole px."""
        m = self.cfg.max_step
        moves = torch.arange(-m, m + 1, dtype=logits.dtype, device=logits.device)
        shape = [1] * logits.dim()
        shape[dim] = -1
        return torch.round((torch.softmax(logits, dim=dim) * moves.view(shape)).sum(dim))

    @torch.no_grad()
    def walk(self, cells: torch.Tensor, layers: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each creature of the latest layer moved into the chunk's `n` (<= horizon) frames:
        (B, n, g, g) bool, a creature starts in the cell, and (B, n, 2, g, g) long, at which
        pixel of it. A creature that walks off the canvas is dropped; of two in one cell, one
        is kept."""
        s, h = self.cfg.spatial, self.cfg.horizon
        if not 1 <= n <= h:
            raise ValueError(f"a creature head walks 1..{h} frames, not {n}")
        present, offsets = read_creatures(layers[:, -1], s)
        moves = self.expected(self(cells, layers), dim=3)[:, :n].long()  # (B, n, 2, g, g)
        b, g = present.shape[0], present.shape[-1]
        c = torch.arange(g, device=moves.device) * s
        corner = torch.stack([c.expand(g, g), c[:, None].expand(g, g)])  # (2, g, g): each cell's (x, y)
        px = (corner + offsets)[:, None] + moves  # (B, n, 2, g, g) canvas px after each frame
        keep = present[:, None] & ((px >= 0) & (px < g * s)).all(dim=2)  # (B, n, g, g)
        cell = torch.div(px, s, rounding_mode="floor")
        # Scattered by tensor ops (no host sync): a dropped creature goes to a spare last slot.
        slot = torch.where(keep, cell[:, :, 1] * g + cell[:, :, 0], g * g).flatten(2)  # (B, n, g*g)
        out_present = keep.new_zeros(b, n, g * g + 1).scatter_(2, slot, keep.flatten(2))
        out_offsets = px.new_zeros(b, n, 2, g * g + 1)
        out_offsets.scatter_(3, slot[:, :, None].expand(-1, -1, 2, -1), (px % s).flatten(3))
        out_present = out_present[..., : g * g].view(b, n, g, g)
        out_offsets = out_offsets[..., : g * g].view(b, n, 2, g, g)
        return out_present, out_offsets

    @torch.no_grad()
    def born(
        self, classes: torch.Tensor, places: torch.Tensor, salt: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The creatures met in tiles seen for the first time: `classes` (B, g, g) long, each
        new tile's codebook class (-1: not new), `places` (B, 2, g, g) long, each tile's (x, y)
        on its session's grid, and the sessions' salts (B,) -> (B, g, g) bool, a creature starts
        there, and (B, 2, g, g) long, at which pixel. A pure function of those (`uniform`): the
        same session state meets the same creatures."""
        s = self.cfg.spatial
        logits = self.births[classes.clamp(min=0)].float()  # (B, g, g, 1 + s*s)
        salt = salt.to(places.device)[:, None, None] + BIRTH_SALT
        grid = places.movedim(1, 0)
        met = (classes >= 0) & (uniform(grid, salt) < torch.sigmoid(logits[..., 0]).double())
        cdf = logits[..., 1:].softmax(-1).cumsum(-1).double()
        where = (cdf < uniform(grid, salt + 1)[..., None]).sum(-1).clamp(max=s * s - 1)
        return met, torch.stack([where % s, torch.div(where, s, rounding_mode="floor")], dim=1)

    @torch.no_grad()
    def enter(self, salt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The creatures that walk onto the canvases of a batch of sessions in a chunk, drawn from
        `entries` in the canvas' outer ring of cells (at most one a cell) by the salts (B,) long
        (a hash of each session's latest frame: the same state, the same draws) -> (B, g, g)
        bool and (B, 2, g, g) long, as `born`."""
        s, g = self.cfg.spatial, self.cfg.canvas
        p = torch.sigmoid(self.entries.float()).view(g, s, g, s).permute(0, 2, 1, 3).reshape(g, g, s * s)
        rate = p.sum(-1).clamp(max=1.0).double()
        ring = torch.ones(g, g, dtype=torch.bool, device=p.device)
        ring[1:-1, 1:-1] = False
        c = torch.arange(g, device=p.device)
        grid = torch.stack(torch.meshgrid(c, c, indexing="xy"))[:, None]  # (2, 1, g, g): (x, y)
        salt = salt.to(p.device)[:, None, None] + BIRTH_SALT
        met = ring & (uniform(grid, salt + 2) < rate)
        cdf = (p / p.sum(-1, keepdim=True).clamp(min=1e-12)).cumsum(-1).double()
        where = (cdf < uniform(grid, salt + 3)[..., None]).sum(-1).clamp(max=s * s - 1)
        return met, torch.stack([where % s, torch.div(where, s, rounding_mode="floor")], dim=1)


def clean_layers(raw: torch.Tensor, s: int) -> torch.Tensor:
    """Raw creature channels (..., 3, g, g) -> the same as the encoder writes them: +-1 and whole
    pixel offsets (`read_creatures`, `creature_channels`; a generated latent's are never exact)."""
    flat = raw.reshape(-1, *raw.shape[-3:])
    return creature_channels(*read_creatures(flat, s), s).view(raw.shape).to(raw.dtype)

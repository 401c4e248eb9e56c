"""A learned terrain prior: which tile comes into view next, given the tiles around it.

Why (issue 11): terrain that scrolls into view cannot be predicted, so the DiT guesses it, and its
guess for a cell it cannot know is close to the mean of what it has seen there; snapped to the
codebook (`FastAutoencoder.snap_cells`) every guess is a tile of the game, but each one on its
own: after a walk the world is a mosaic of lakes without shores, scattered wall tiles and stripes
where a column was copied on (model card, "Terrain from a prior"). The game's terrain has
structure a few tiles wide: smooth patches, sand around water, straight walls. This prior learns
it from the game's maps alone, as a classifier over the autoencoder's codebook (fit on frames):
the tiles of a `window` x `window` neighbourhood (each a codebook entry or unknown) -> the
distribution of the centre tile.
A session's atlas draws every tile that comes into view for the first time from it
(`Cartographer.recall`), in two interleaved passes so neighbours in the new row or column see
each other, and pins it like a remembered tile; the DiT draws the frames around it.

A draw is a pure function of the context, the tile's place on the session's grid (in tiles from
the start frame's anchor) and the session's salt (`Atlas.salt`, a hash of its start frame):
the same session state invents the same tiles, so chunks and forks stay deterministic without a
random generator in the atlas.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TerrainPriorConfig:
    """What a terrain prior reads and predicts."""

    classes: int  # codebook entries (the autoencoder's `FastAEConfig.codebook`, in its order)
    window: int = 7  # tiles across the neighbourhood it reads (odd; the tile itself at the centre)
    width: int = 128  # hidden units of each of its two layers

    def __post_init__(self) -> None:
        if self.classes < 2:
            raise ValueError(f"a terrain prior chooses among at least 2 tiles, not {self.classes}")
        if self.window < 3 or self.window % 2 == 0:
            raise ValueError(f"a terrain prior's window is odd and at least 3, not {self.window}")

    @property
    def unknown(self) -> int:
        """The class index of a tile nobody has shown."""
        return self.classes

    def to_dict(self) -> dict:
        """JSON-ready (worldserve.json "terrain")."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TerrainPriorConfig:
        """Inverse of `to_dict`."""
        return cls(**data)


class TerrainPrior(nn.Module):
    """Neighbourhood of tile classes -> logits of the centre tile (an MLP on the one-hot window)."""

    def __init__(self, cfg: TerrainPriorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_in = (cfg.classes + 1) * cfg.window**2
        self.net = nn.Sequential(
            nn.Linear(n_in, cfg.width),
            nn.GELU(),
            nn.Linear(cfg.width, cfg.width),
            nn.GELU(),
            nn.Linear(cfg.width, cfg.classes),
        )

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """Tile classes (N, window, window) long (`unknown` where not known) -> logits (N, classes)
        of the centre tile."""
        # The first layer reads a one-hot window: a sum of one weight column per tile, gathered
        # (a tenth of the matmul's work; the same function).
        first = self.net[0]
        n = self.cfg.window**2
        cols = windows.flatten(1) + torch.arange(n, device=windows.device) * (self.cfg.classes + 1)
        hidden = F.embedding_bag(cols, first.weight.t().contiguous(), mode="sum") + first.bias
        return self.net[1:](hidden)

    @torch.no_grad()
    def fill(
        self, region: torch.Tensor, fresh: torch.Tensor, places: torch.Tensor, salt: torch.Tensor | int = 0
    ) -> torch.Tensor:
        """Tile classes `region` (..., g + 2r, g + 2r) long (`unknown` where not known;
        r = window // 2) around g x g canvases (any leading axes: a batch of sessions) -> the
        canvases' classes (..., g, g) with every tile where `fresh` (..., g, g) bool drawn from the
        prior, in two passes (tiles with an even sum of coordinates, then the odd, which see the
        even ones); `places` (..., 2, g, g) long is each canvas tile's (x, y) on its session's
        grid, which with the session's `salt` (int, or a tensor of the leading shape) picks the
        draw (`uniform`). Tensor ops only (no host sync)."""
        w, r = self.cfg.window, self.cfg.window // 2
        g = fresh.shape[-1]
        region = region.clone()
        parity = places.sum(dim=-3) % 2
        salt = torch.as_tensor(salt, device=places.device)[..., None, None]
        u = uniform(places.movedim(-3, 0), salt).reshape(-1, 1)
        for p in (0, 1):
            windows = region.unfold(-2, w, 1).unfold(-2, w, 1).reshape(-1, w, w)  # (... g g, w, w)
            cdf = self(windows).float().softmax(-1).cumsum(-1)
            drawn = (cdf < u).sum(-1).clamp(max=self.cfg.classes - 1).view(fresh.shape)
            centre = region[..., r : r + g, r : r + g]
            region[..., r : r + g, r : r + g] = torch.where(fresh & (parity == p), drawn, centre)
        return region[..., r : r + g, r : r + g]


def uniform(places: torch.Tensor, salt: torch.Tensor | int = 0) -> torch.Tensor:
    """(2, ...) long tile places and a session's `salt` -> (...) float64 in [0, 1): a fixed hash
    of each place, the draw of the tile there (multiply-xorshift mixing in int64; the wraps are
    intended). The salt keeps sessions from sharing draws: places count from each session's
    start, so without it every session would meet the same draws at the same steps from home."""
    h = places[0] * 0x9E3779B1 + places[1] * 0x85EBCA77 + salt * 0xC2B2AE3D
    h = (h ^ (h >> 17)) * 0x165667B1
    h = (h ^ (h >> 15)) * 0x2C1B3C6D
    h = (h ^ (h >> 12)) * 0x297A2D39
    h = h ^ (h >> 15)
    return (h & 0xFFFFFF).double() / float(1 << 24)

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
(`Cartographer.recall`), coarse to fine in seven passes by place (`pass_order`) so neighbours in
the new row or column see each other, and pins it like a remembered tile; the DiT draws the frames
around it.

A draw is a pure function of the context, the tile's place on the session's grid (in tiles from
the start frame's anchor) and the session's salt (`Atlas.salt`, a hash of its start frame):
the same session state invents the same tiles, so chunks and forks stay deterministic without a
random generator in the atlas.
"""

from __future__ import annotations

import functools
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
        prior, in the passes of `pass_order` (later passes see the earlier ones); `places`
        (..., 2, g, g) long is each canvas tile's (x, y) on its session's grid, consecutive along
        each axis, which with the session's `salt` (int, or a tensor of the leading shape) picks
        the draw (`uniform`) and the pass. Each pass reads only its own tiles' windows; tensor ops
        only (no host sync)."""
        w, r, span = self.cfg.window, self.cfg.window // 2, PASS_SPAN
        lead, g = fresh.shape[:-2], fresh.shape[-1]
        big = -(-g // span) * span  # the canvas padded to whole spans: each pass as many tiles everywhere
        side = big + 2 * r
        pad = big - g
        flat = F.pad(region.reshape(-1, g + 2 * r, g + 2 * r), (0, pad, 0, pad), value=self.cfg.unknown)
        n, dev = flat.shape[0], places.device
        flat = flat.flatten(1)  # (n, side^2)
        steps = torch.arange(big, device=dev)
        corner = places.reshape(n, 2, g, g)[:, :, 0, 0]  # (n, 2): each canvas' first tile
        xs = (corner[:, 0, None, None] + steps).expand(n, big, big)
        ys = (corner[:, 1, None, None] + steps[:, None]).expand(n, big, big)
        order = pass_order(xs, ys).flatten(1).argsort(dim=1, stable=True)  # (n, big^2): tiles by pass
        salt = torch.as_tensor(salt, device=dev).expand(lead).reshape(n, 1, 1)
        u = uniform(torch.stack([xs, ys]), salt).flatten(1).gather(1, order)
        todo = F.pad(fresh.reshape(-1, g, g), (0, pad, 0, pad)).flatten(1).gather(1, order)
        top = (order // big) * side + order % big  # each tile's window's first cell in `flat`
        cells = (torch.arange(w, device=dev)[:, None] * side + torch.arange(w, device=dev)).flatten()
        windows = top[..., None] + cells  # (n, big^2, w^2)
        centre = top + r * side + r
        start = 0
        for size in pass_sizes(big):
            at = slice(start, start + size)
            start += size
            picked = flat.gather(1, windows[:, at].flatten(1)).view(-1, w, w)
            cdf = self(picked).float().softmax(-1).cumsum(-1)
            drawn = (cdf < u[:, at].reshape(-1, 1)).sum(-1).clamp(max=self.cfg.classes - 1).view(n, size)
            old = flat.gather(1, centre[:, at])
            flat = flat.scatter(1, centre[:, at], torch.where(todo[:, at], drawn, old))
        return flat.view(n, side, side)[:, r : r + g, r : r + g].reshape(*lead, g, g)


# Fill order: a tile's pass is the sum of the ranks of its place's residues modulo PASS_SPAN on
# each axis, ranked coarse to fine (0, 2, 1, 3). Along a new row or column the first pass draws
# every fourth tile, the next the midpoints between them, the last two the rest, each seeing both
# neighbours; tiles next to each other never share a pass. One pass per tile would be exact but
# serial; two interleaved passes let tiles two apart disagree with nothing between them: 0.378
# kind changes per neighbouring pair along new lines against the game maps' 0.226 (these passes:
# 0.316; benchmarks/terrain_fill.py).
PASS_SPAN = 4
RESIDUE_RANK = (0, 2, 1, 3)  # residue -> its rank: 0 first, then 2, then 1, then 3


def pass_order(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Tile places (long, any shape) -> the pass (0 .. 2 PASS_SPAN - 2) that draws each."""
    rank = torch.tensor(RESIDUE_RANK, device=xs.device)
    return rank[xs % PASS_SPAN] + rank[ys % PASS_SPAN]


@functools.lru_cache(maxsize=8)  # one entry per canvas size a server has
def pass_sizes(side: int) -> tuple[int, ...]:
    """The tiles each pass draws on a `side` x `side` canvas (`side` a multiple of PASS_SPAN)."""
    block = torch.arange(PASS_SPAN)
    per_block = torch.bincount(pass_order(block[None, :], block[:, None]).flatten())
    return tuple((per_block * (side // PASS_SPAN) ** 2).tolist())


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

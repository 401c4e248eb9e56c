"""A session's map of the terrain it has shown, for worlds on tile-aligned latents.

Why (issue 11): the DiT attends to a window of recent frames only, so terrain that scrolls out of
view and back is invented anew: a lake the player walked past is somewhere else on the way back,
and the world's border wall comes back elsewhere or not at all, so the camera stops where the
game's does not. A world whose key gate plans the motion (`KeyGate.plan`) knows exactly where
every frame lies on the tile grid, so it can keep what it has shown. The atlas holds every flat
tile a session has shown (a terrain tile, not part of a creature: `FastAutoencoder.flat_cells`) at
its place on the grid; when a chunk's frames bring remembered tiles back into view, the sampler
draws the chunk around them (`World.steer` pins them as it pins the plan). Tiles never shown are
invented as before, and tiles in the latest frame are left to the DiT (its history holds them,
and a creature may walk over them).

Bounded: `tiles` x `tiles` slots; the tile at (x, y) (in tiles from the start frame's anchor)
lives in slot (y mod tiles, x mod tiles), tagged with (x, y), and a newer tile overwrites an older
one in its slot, so the atlas holds at least the `tiles` x `tiles` tiles around the latest view
and never grows. An atlas is never written in place: a chunk makes a new version, which its
commit installs (`Transaction.commit`), so a fork shares it and a rolled-back chunk leaves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.fast_decoder import FastAutoencoder

EMPTY = -(2**62)  # the tag of a slot that holds nothing


@dataclass(frozen=True)
class Atlas:
    """One version of a session's map (never written in place)."""

    cells: torch.Tensor  # (k, N, N) normalised cell latents: slot [y mod N, x mod N] holds tile (x, y)
    tags: torch.Tensor  # (2, N, N) long: the tile (x, y) in each slot, EMPTY where none
    origin: torch.Tensor  # (2,) long: the tile (x, y) under canvas cell (0, 0) of the latest frame

    @property
    def nbytes(self) -> int:
        """Bytes the version holds."""
        return sum(t.numel() * t.element_size() for t in (self.cells, self.tags, self.origin))


class Cartographer:
    """Writes and reads the atlases of one world's tile-aligned autoencoder. Latents in and out
    are normalised, as the DiT sees them; the autoencoder runs in its own dtype."""

    def __init__(self, ae: FastAutoencoder, tiles: int) -> None:
        cfg = ae.cfg
        if not cfg.frame_size:
            raise ValueError("an atlas needs tile-aligned latents (FastAEConfig.frame_size)")
        if tiles < cfg.canvas_cells:
            raise ValueError(f"an atlas of {tiles} tiles is smaller than a latent frame's {cfg.canvas_cells}")
        self.ae, self.tiles = ae, tiles
        self.k, self.s, self.g, self.size = cfg.cell_channels, cfg.spatial, cfg.canvas_cells, cfg.frame_size

    @property
    def mean(self) -> torch.Tensor:
        """(C, 1, 1) the latents' normalisation (read each time: weights load after construction)."""
        return self.ae.latents_mean[:, 0]

    @property
    def std(self) -> torch.Tensor:
        """(C, 1, 1) the latents' scale (as `mean`)."""
        return self.ae.latents_std[:, 0]

    def phase(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latent frames (N, C, h, w) -> where each view lies on its canvas (N, 2) long
        (`FastAutoencoder.read_phases`)."""
        return self.ae.read_phases(z.to(self.std.dtype))

    @torch.no_grad()
    def moves(self, x0: torch.Tensor) -> torch.Tensor:
        """Generated chunks (B, C, n, h, w), before `canonical` -> the tiles (B, 2) each one's anchor
        moves (`FastAutoencoder.anchor_moves`)."""
        return self.ae.anchor_moves(x0.to(self.std.dtype))

    @torch.no_grad()
    def start(self, z: torch.Tensor) -> Atlas:
        """The atlas of a session whose only frame is `z` (C, 1, h, w) (its start frame)."""
        n = self.tiles
        empty = Atlas(
            cells=z.new_zeros(self.k, n, n),
            tags=torch.full((2, n, n), EMPTY, dtype=torch.long, device=z.device),
            origin=torch.zeros(2, dtype=torch.long, device=z.device),
        )
        return self.write(empty, torch.zeros_like(empty.origin), z)

    @torch.no_grad()
    def write(self, atlas: Atlas, moved: torch.Tensor, z: torch.Tensor) -> Atlas:
        """The atlas after a chunk: its anchor `moved` (2,) tiles (`moves`) and its last frame `z`
        (C, 1, h, w) in canonical form, whose flat tiles wholly in view are remembered."""
        origin = atlas.origin + moved.to(atlas.origin.device)
        frame = z[:, 0][None]  # (1, C, h, w)
        pos = self.phase(frame) + 2 * self.s  # the view's top-left corner on the canvas
        raw = frame[:, : self.k].to(self.std.dtype) * self.std[: self.k] + self.mean[: self.k]
        flat, _ = self.ae.flat_cells(raw, self.ae.view_cover(pos, self.g))
        keep = (flat & self.whole(pos))[0, 0]  # (g, g)
        tiles, sy, sx = self.slots(origin)
        cells, tags = atlas.cells.clone(), atlas.tags.clone()
        # A frame's g x g tiles fall in distinct slots (tiles >= g), so one indexed write suffices.
        cells[:, sy, sx] = torch.where(keep, frame[0, : self.k].to(cells.dtype), cells[:, sy, sx])
        tags[:, sy, sx] = torch.where(keep, tiles, tags[:, sy, sx])
        return Atlas(cells, tags, origin)

    @torch.no_grad()
    def recall(
        self, atlas: Atlas, last: torch.Tensor, phases: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the atlas knows of a chunk drawn on the anchor of the session's latest frame `last`
        (C, 1, h, w), whose frames lie at `phases` (2, n) px on that canvas: the normalised cell
        channels (k, n, h, w) as the encoder writes them for each frame's view, and where they hold
        (1, n, h, w) bool: remembered tiles in that frame's view that the latest frame does not
        show wholly."""
        n = phases.shape[1]
        tiles, sy, sx = self.slots(atlas.origin)
        known = (atlas.tags[:, sy, sx] == tiles).all(dim=0)  # (g, g)
        shown = self.whole(self.phase(last[:, 0][None]) + 2 * self.s)[0, 0]
        pos = phases.t().to(torch.long) + 2 * self.s  # (n, 2)
        cover = self.ae.view_cover(pos, self.g)  # (n, 1, S, S)
        kept = atlas.cells[:, sy, sx].to(self.std.dtype)  # (k, g, g) normalised
        raw = kept * self.std[: self.k] + self.mean[: self.k]
        pixels = self.ae.decoder(raw[None]).clamp(-1, 1).expand(n, -1, -1, -1)
        seen = (self.ae.encode_seen(pixels, cover) - self.mean[: self.k]) / self.std[: self.k]
        # A tile wholly in view is the remembered code itself; one the view cuts is re-encoded as
        # the encoder writes a cut tile.
        values = torch.where(self.whole(pos), kept[None], seen)  # (n, k, g, g)
        in_view = torch.nn.functional.max_pool2d(cover, self.s) > 0  # (n, 1, g, g)
        mask = in_view & known & ~shown
        return values.transpose(0, 1).to(last.dtype), mask.transpose(0, 1)

    def whole(self, pos: torch.Tensor) -> torch.Tensor:
        """(N, 1, g, g) bool: the cells every pixel of which lies in a view at `pos` (N, 2)."""
        edge = torch.arange(self.g, device=pos.device) * self.s
        inside = (edge >= pos[..., None]) & (edge + self.s <= pos[..., None] + self.size)  # (N, 2, g)
        return (inside[:, 1, :, None] & inside[:, 0, None, :])[:, None]

    def slots(self, origin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tiles (2, g, g) (x, y) under a canvas whose cell (0, 0) is `origin`, and their slots'
        row and column (g, g) each."""
        c = torch.arange(self.g, device=origin.device)
        tiles = torch.stack(
            [
                (origin[0] + c)[None, :].expand(self.g, -1),
                (origin[1] + c)[:, None].expand(-1, self.g),
            ]
        )
        return tiles, tiles[1] % self.tiles, tiles[0] % self.tiles

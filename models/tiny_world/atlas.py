"""A session's map of the terrain it has shown, for worlds on tile-aligned latents.

Why (issue 11): the DiT attends to a window of recent frames only, so terrain that scrolls out of
view and back is invented anew: a lake the player walked past is somewhere else on the way back,
and the world's border wall comes back elsewhere or not at all, so the camera stops where the
game's does not. A world whose learned motion head plans each chunk's motion
(models/tiny_world/motion_head.py) places every frame on the tile grid by that prediction, so it
can keep what it has shown: the head's predicted pose is the memory's address, and a pose it
predicts wrongly files and recalls tiles in the wrong place. The atlas holds every flat
tile a session has shown (a terrain tile, not part of a creature: `FastAutoencoder.flat_cells`) at
its place on the grid; when a chunk's frames bring remembered tiles back into view, the sampler
draws the chunk around them (`World.steer` pins them as it pins the plan). Tiles never shown are
drawn from the world's terrain prior where it has one (`invent`, models/tiny_world/terrain_prior.py: the
structure of the training worlds' maps, lakes with shores and straight walls, where the DiT's own
guesses were a mosaic) and pinned alike; without one the DiT invents them. Tiles in the latest
frame are left to the DiT (its history holds them, and a creature may walk over them). Tiles are
named by the autoencoder's codebook (`FastAEConfig.codebook`, fit on training frames); the atlas
knows no world size and no wall colour: where the world ends is the models' to draw.

Creatures (issue 41; worlds whose autoencoder has a creature layer): the atlas also remembers,
for every tile a session's canvas has held, where a creature's square started in it when the
canvas last held it, or that none did (`file_creatures`). The canvas forgets a creature whose
tile scrolls off it; when that tile comes back onto the canvas, `remembered` returns the creature
for the chunk to draw there (the creature head walks it on from the next chunk). Addressed, like
the terrain, by the motion head's predicted pose; nothing of the game is written here, and a
remembered creature stands where it was last seen. One that walks off the canvas is not filed
(the creature head's entries stand for those that come back).

Bounded: `tiles` x `tiles` slots; the tile at (x, y) (in tiles from the start frame's anchor)
lives in slot (y mod tiles, x mod tiles), tagged with (x, y), and a newer tile overwrites an older
one in its slot, so the atlas holds at least the `tiles` x `tiles` tiles around the latest view
and never grows. An atlas is never written in place: a chunk makes a new version, which its
commit installs (`Transaction.commit`), so a fork shares it and a rolled-back chunk leaves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from models.tiny_world.fast_decoder import FastAutoencoder, read_creatures
from models.tiny_world.terrain_prior import TerrainPrior

EMPTY = -(2**62)  # the tag of a slot that holds nothing


@dataclass(frozen=True)
class Atlas:
    """One version of a session's map (never written in place)."""

    cells: torch.Tensor  # (k, N, N) normalised cell latents: slot [y mod N, x mod N] holds tile (x, y)
    tags: torch.Tensor  # (2, N, N) long: the tile (x, y) in each slot, EMPTY where none
    origin: torch.Tensor  # (2,) long: the tile (x, y) under canvas cell (0, 0) of the latest frame
    salt: torch.Tensor  # () long: a hash of the start frame, which picks the terrain prior's draws
    # Creature memory (M = N with a creature layer, else 0): the tile (x, y) each slot last held
    # on a canvas (EMPTY where none), and the pixel of it where a creature's square started then
    # (y * spatial + x; -1: none).
    creature_tags: torch.Tensor  # (2, M, M) long
    creature_at: torch.Tensor  # (M, M) int8

    @classmethod
    def stack(cls, atlases: list[Atlas]) -> Atlas:
        """Several sessions' atlases as one batch: each field gains a leading session axis (what
        `Cartographer.recall` reads, so a batch's sessions recall together)."""
        return cls(*(torch.stack([getattr(a, f.name) for a in atlases]) for f in fields(cls)))

    @property
    def nbytes(self) -> int:
        """Bytes the version holds."""
        return sum(getattr(self, f.name).numel() * getattr(self, f.name).element_size() for f in fields(self))


def fingerprint(z: torch.Tensor) -> torch.Tensor:
    """() long: a hash of a latent frame z (C, 1, h, w), its values to 1/256 (tensor ops only)."""
    q = (z.float() * 256).round().long().flatten()
    weights = torch.arange(1, 2 * q.numel(), 2, device=q.device) * 0x9E3779B1
    return (q * weights).sum()


class Cartographer:
    """Writes and reads the atlases of one world's tile-aligned autoencoder. Latents in and out
    are normalised, as the DiT sees them; the autoencoder runs in its own dtype."""

    def __init__(self, ae: FastAutoencoder, tiles: int) -> None:
        """An atlas of `tiles` x `tiles` slots. Without a terrain prior (`set_prior`) the DiT
        invents the tiles that come into view for the first time."""
        cfg = ae.cfg
        if not cfg.frame_size:
            raise ValueError("an atlas needs tile-aligned latents (FastAEConfig.frame_size)")
        if tiles < cfg.canvas_cells:
            raise ValueError(f"an atlas of {tiles} tiles is smaller than a latent frame's {cfg.canvas_cells}")
        self.ae, self.tiles = ae, tiles
        self.k, self.s, self.g, self.size = cfg.cell_channels, cfg.spatial, cfg.canvas_cells, cfg.frame_size
        self.prior: TerrainPrior | None = None
        self.memory = tiles if cfg.creatures else 0  # creature memory slots per side

    def set_prior(self, prior: TerrainPrior) -> None:
        """Draw the tiles that come into view for the first time from `prior` (`invent`)."""
        if prior.cfg.classes != len(self.ae.cfg.codebook):
            n = len(self.ae.cfg.codebook)
            raise ValueError(f"terrain prior chooses among {prior.cfg.classes} tiles, the codebook has {n}")
        self.prior = prior

    def nbytes(self, itemsize: int) -> int:
        """Bytes of one atlas version whose cell latents take `itemsize` bytes each (`Atlas.nbytes`)."""
        creatures = (2 * 8 + 1) * self.memory**2  # two long tags and one int8 pixel a slot
        return self.k * self.tiles**2 * itemsize + (2 * self.tiles**2 + 2 + 1) * 8 + creatures

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
            salt=fingerprint(z),
            **self.no_creatures(z.device),
        )
        return self.write(self.file_creatures(empty, z), torch.zeros_like(empty.origin), z)

    def no_creatures(self, device: torch.device) -> dict[str, torch.Tensor]:
        """An empty creature memory: `Atlas`'s creature fields (also what a snapshot written
        before the memory existed loads with)."""
        m = self.memory
        return {
            "creature_tags": torch.full((2, m, m), EMPTY, dtype=torch.long, device=device),
            "creature_at": torch.full((m, m), -1, dtype=torch.int8, device=device),
        }

    @torch.no_grad()
    def write(self, atlas: Atlas, moved: torch.Tensor, z: torch.Tensor) -> Atlas:
        """The atlas after a chunk: its anchor `moved` (2,) tiles (`moves`) and its last frame `z`
        (C, 1, h, w) in canonical form, whose flat tiles wholly in view are remembered."""
        origin = atlas.origin + moved.to(atlas.origin.device)
        frame = z[:, 0][None]  # (1, C, h, w)
        pos = self.corner(z)[None]
        raw = frame[:, : self.k].to(self.std.dtype) * self.std[: self.k] + self.mean[: self.k]
        flat, _ = self.ae.flat_cells(raw, self.ae.view_cover(pos, self.g))
        keep = (flat & self.whole(pos))[0, 0]  # (g, g)
        tiles, sy, sx = self.slots(origin)
        cells, tags = atlas.cells.clone(), atlas.tags.clone()
        # A frame's g x g tiles fall in distinct slots (tiles >= g), so one indexed write suffices.
        cells[:, sy, sx] = torch.where(keep, frame[0, : self.k].to(cells.dtype), cells[:, sy, sx])
        tags[:, sy, sx] = torch.where(keep, tiles, tags[:, sy, sx])
        return replace(atlas, cells=cells, tags=tags, origin=origin)

    @torch.no_grad()
    def file_creatures(self, atlas: Atlas, z: torch.Tensor) -> Atlas:
        """The atlas with its creature memory refiled from a frame `z` (C, 1, h, w) on the canvas
        of `atlas.origin` (a chunk's last frame before `canonical` moves it; `write` moves the
        origin after): every cell of that canvas as `z` has it. Cells a later move brings onto
        the canvas keep what is filed (`remembered`). Without a creature layer, `atlas` as it is."""
        if not self.memory:
            return atlas
        cs, s = self.ae.cfg.creature_slice, self.s
        tiles, sy, sx = self.slots(atlas.origin)
        raw = z[cs, 0][None].to(self.std.dtype) * self.std[cs] + self.mean[cs]
        present, offsets = read_creatures(raw, s)
        tags, at = atlas.creature_tags.clone(), atlas.creature_at.clone()
        # A canvas's g x g tiles fall in distinct slots (tiles >= g): one indexed write each.
        tags[:, sy, sx] = tiles
        at[sy, sx] = torch.where(present[0], offsets[0, 1] * s + offsets[0, 0], -1).to(at.dtype)
        return replace(atlas, creature_tags=tags, creature_at=at)

    @torch.no_grad()
    def remembered(self, atlas: Atlas, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The creatures a batch of sessions' atlases (`Atlas.stack`) bring back onto the canvases
        of their latest frames `last` (B, C, 1, h, w): where a remembered creature's square starts
        in a tile of the canvas and the latest frame shows no creature in that cell or the eight
        around it (one that walked there is the same creature) -> (B, g, g) bool and (B, 2, g, g)
        long, at which pixel (as `CreatureHead.born`)."""
        s = self.s
        tiles, sy, sx = self.slots(atlas.origin)
        same = (self.gather(atlas.creature_tags, sy, sx) == tiles).all(dim=1)  # (B, g, g)
        at = self.gather(atlas.creature_at[:, None], sy, sx)[:, 0].long()
        cs = self.ae.cfg.creature_slice
        raw = last[:, cs, 0].to(self.std.dtype) * self.std[cs] + self.mean[cs]
        shown, _ = read_creatures(raw, s)
        near = F.max_pool2d(shown[:, None].to(self.std.dtype), 3, stride=1, padding=1)[:, 0] > 0
        met = same & (at >= 0) & ~near
        where = at.clamp(min=0)
        return met, torch.stack([where % s, torch.div(where, s, rounding_mode="floor")], dim=1)

    def corner(self, z: torch.Tensor) -> torch.Tensor:
        """(..., 2) px: the top-left corner of the view of each latent frame z (..., C, 1, h, w)
        on its canvas."""
        frames = z.reshape(-1, *z.shape[-4:])[:, :, 0]  # (N, C, h, w)
        return (self.phase(frames) + 2 * self.s).reshape(*z.shape[:-4], 2)

    @torch.no_grad()
    def codes(self, colours: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
        """(len(colours), k) the normalised cell latents of a flat tile of each colour (RGB 0-255)
        wholly in view (the codec is per cell: one cell's canvas each is enough)."""
        colour = torch.tensor(colours, dtype=self.std.dtype, device=self.std.device) / 127.5 - 1
        pixels = colour[:, :, None, None].expand(-1, 3, self.s, self.s)
        raw = self.ae.encode_seen(pixels, torch.ones_like(pixels[:, :1]))[:, :, 0, 0]
        return (raw - self.mean[: self.k, 0, 0]) / self.std[: self.k, 0, 0]

    @torch.no_grad()
    def recall(
        self, atlas: Atlas, last: torch.Tensor, phases: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a batch of sessions' atlases (`Atlas.stack`: B sessions) know of a chunk each draws
        on the anchor of its latest frame `last` (B, C, 1, h, w), whose frames lie at `phases`
        (B, 2, n) px on that canvas: the normalised cell channels (B, k, n, h, w) as the encoder
        writes them for each frame's view, and where they hold (B, 1, n, h, w) bool: remembered
        tiles in that frame's view that the latest frame does not show wholly. With a terrain
        prior, every tile the chunk brings into view that was neither remembered nor begun by the
        latest frame (whose shade the DiT goes on drawing) is drawn from it (`invent`); the third
        result is the codebook class (B, g, g) long of each tile so drawn (-1 elsewhere, and
        everywhere without a prior), where a world meets its creatures (`CreatureHead.born`). The
        sessions run as one batch: a few dozen tensor ops per chunk whatever their number."""
        b, n, g = phases.shape[0], phases.shape[2], self.g
        tiles, sy, sx = self.slots(atlas.origin)  # (B, 2, g, g), (B, g, g) each
        known = (self.gather(atlas.tags, sy, sx) == tiles).all(dim=1)  # (B, g, g)
        kept = self.gather(atlas.cells, sy, sx).to(self.std.dtype)  # (B, k, g, g) normalised
        latest = self.corner(last)  # (B, 2)
        shown = self.whole(latest)[:, 0]
        latest_cover = self.ae.view_cover(latest, g)
        begun = F.max_pool2d(latest_cover, self.s)[:, 0] > 0
        pos = phases.transpose(1, 2).reshape(b * n, 2).to(torch.long) + 2 * self.s
        cover = self.ae.view_cover(pos, g)  # (B n, 1, S, S)
        in_view = (F.max_pool2d(cover, self.s) > 0).view(b, n, g, g)
        drawn = torch.full((b, g, g), -1, dtype=torch.long, device=kept.device)
        if self.prior is not None:
            fresh = in_view.any(dim=1) & ~known & ~begun
            drawn = self.invent(atlas, last, latest_cover, kept, known, fresh)
            codes = self.codes(tuple(tuple(c) for c in self.ae.cfg.codebook)).to(kept.dtype)  # (K, k)
            kept = torch.where(fresh[:, None], codes[drawn.clamp(min=0)].movedim(-1, 1), kept)
            known = known | fresh
        raw = kept * self.std[: self.k] + self.mean[: self.k]
        pixels = self.ae.decoder(raw).clamp(-1, 1).repeat_interleave(n, dim=0)  # (B n, 3, S, S)
        seen = (self.ae.encode_seen(pixels, cover) - self.mean[: self.k]) / self.std[: self.k]
        # A tile wholly in view is the remembered code itself; one the view cuts is re-encoded as
        # the encoder writes a cut tile.
        whole = self.whole(pos).view(b, n, 1, g, g)
        values = torch.where(whole, kept[:, None], seen.view(b, n, self.k, g, g))
        mask = in_view & known[:, None] & ~shown[:, None]
        return values.transpose(1, 2).to(last.dtype), mask[:, None], drawn

    @torch.no_grad()
    def invent(
        self,
        atlas: Atlas,
        last: torch.Tensor,
        latest_cover: torch.Tensor,
        kept: torch.Tensor,
        known: torch.Tensor,
        fresh: torch.Tensor,
    ) -> torch.Tensor:
        """(B, g, g) long: the codebook class of each `fresh` (B, g, g) tile of the canvases of a
        batch of sessions' latest frames `last` (B, C, 1, h, w) (`recall`), drawn from the terrain
        prior around what each session knows: its atlas' tiles a prior's window around the canvas,
        the tiles `kept` (B, k, g, g) where `known`, and every flat tile its latest frame shows
        through `latest_cover`, even in part (its colour); -1 where not fresh."""
        assert self.prior is not None
        r, g, unknown = self.prior.cfg.window // 2, self.g, self.prior.cfg.unknown
        codes = self.codes(tuple(tuple(c) for c in self.ae.cfg.codebook))  # (K, k)

        def nearest(cells: torch.Tensor) -> torch.Tensor:  # (B, k, ...) normalised -> (B, ...) codebook index
            return (cells.movedim(1, -1)[..., None, :] - codes).square().sum(-1).argmin(-1)

        places, sy, sx = self.slots(atlas.origin, r)
        seen = (self.gather(atlas.tags, sy, sx) == places).all(dim=1)
        region = torch.where(seen, nearest(self.gather(atlas.cells, sy, sx).to(codes.dtype)), unknown)
        central = torch.where(known, nearest(kept.to(codes.dtype)), unknown)
        raw = last[:, : self.k, 0].to(self.std.dtype) * self.std[: self.k] + self.mean[: self.k]
        flat, colour = self.ae.flat_cells(raw, latest_cover)
        region[:, r : r + g, r : r + g] = torch.where(flat[:, 0], self.ae.codebook_index(colour), central)
        drawn = self.prior.fill(region, fresh, places[..., r : r + g, r : r + g], atlas.salt)
        return torch.where(fresh, drawn, -1)

    @staticmethod
    def gather(slots: torch.Tensor, sy: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """A batch's atlas slots (B, c, N, N) at each session's slot rows `sy` and columns `sx`
        (B, G, G) -> (B, c, G, G)."""
        batch = torch.arange(slots.shape[0], device=slots.device)[:, None, None]
        return slots[batch, :, sy, sx].movedim(-1, 1)

    def whole(self, pos: torch.Tensor) -> torch.Tensor:
        """(N, 1, g, g) bool: the cells every pixel of which lies in a view at `pos` (N, 2)."""
        edge = torch.arange(self.g, device=pos.device) * self.s
        inside = (edge >= pos[..., None]) & (edge + self.s <= pos[..., None] + self.size)  # (N, 2, g)
        return (inside[:, 1, :, None] & inside[:, 0, None, :])[:, None]

    def slots(self, origin: torch.Tensor, margin: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tiles (..., 2, G, G) (x, y) under canvases whose cell (0, 0) is `origin` (..., 2),
        widened by `margin` tiles on every side (G = g + 2 margin), and their slots' row and
        column (..., G, G) each."""
        c = torch.arange(-margin, self.g + margin, device=origin.device)
        x = (origin[..., 0, None, None] + c[None, :]).expand(*origin.shape[:-1], len(c), len(c))
        y = (origin[..., 1, None, None] + c[:, None]).expand(*origin.shape[:-1], len(c), len(c))
        return torch.stack([x, y], dim=-3), y % self.tiles, x % self.tiles

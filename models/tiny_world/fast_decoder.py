"""A fast streaming autoencoder of our own: per-frame 2D convs plus an optional causal temporal input.

Why: the full Wan VAE decode costs more than the DiT (~43 ms per latent frame at 352x640 on an
H200 in bf16, as measured before this project's own GPU runs; ~30 ms per frame even at tiny sizes
on a CPU). A world only needs a decoder
that is fast, causal and exact when streamed. This one keeps all spatial work per latent frame and
puts time in exactly one place, the decoder's input conv, which sees the current latent frame and
the `temporal_kernel - 1` latent frames before it. The streaming cache is those previous latent
frames, so a chunk-by-chunk decode equals a whole-clip decode by construction.

References (read, not copied): the Wan VAE (causal temporal conv with a cache of tail frames,
first latent frame -> one video frame), LTX-Video / DC-AE (most compression in channels, decode by
pixel shuffle), taesd (a tiny conv decoder standing in for a big VAE at preview speed).

Layout::

    encode  frames (T, H, W, 3) uint8
              -> per frame: conv_in, [down (stride 2) + res block] x log2(spatial)  (c_last, h, w)
              -> group `temporal` frames along channels (the first alone, repeated, when
                 first_is_single) -> 1x1 conv -> normalised latents (C, n, h, w)
    decode  latents (C, n, h, w) -> concat the latent frame with the temporal_kernel - 1 before it
              -> per latent frame: conv_in, res blocks, [pixel-shuffle up + res block] x log2(spatial)
              -> conv_out to 3 * temporal channels -> `temporal` video frames per latent frame

Configs: the tiny world uses per-frame latents (temporal 1, kernel 1: no cache tensors at all);
`FastAEConfig.wan_like()` is the shape that would sit behind full-size Wan latents (16 channels,
8x spatial, 4x temporal, first latent frame -> one video frame, kernel 2).

Tile-aligned mode (`frame_size` > 0, for worlds drawn on a grid of `spatial`-px tiles, like the
built-in game; s = spatial): a frame's latents are cells of a canvas on the tile grid, every cell
encoded from its own pixels alone (`CellEncoder`) and drawn alone (`CellDecoder`), plus where the
frame lies on that canvas, its phase p, in 4 channels (cos, sin of 2 pi p / 2s for x and y, the same
in every cell). The canvas is anchored at a tile corner and reaches two cells past the frame on
every side; the frame sits at 2s + p with p in [-s/2, 3s/2).

Why (issue 11): with per-cell codes a scroll never re-synthesises a tile, and within one anchor
it is only a change of phase. The one discrete event, the view entering the next tile, is kept
out of the model's hands: a generated chunk is drawn on the anchor of the history frame before
it (so it only copies cells and moves the phase, up to half a tile either way), and
`canonical` re-anchors it, by shifting whole cells, on its own last frame before it becomes
history. An encoded frame (`encode`) is on its own anchor, p = its sub-tile offset in [0, s),
given when known or read off the tile edges (`PhaseNet`). `encode_wide` and `at_anchor` give the
trainer a frame on a neighbouring anchor, as the model sees it in a chunk.

Sprite layer (`sprite`, tile-aligned mode only): one sprite that moves with the view, not with
the canvas (the game's player, drawn at the view's centre), is kept out of the cells. Three more
channels, the same in every cell, hold its centre in view pixels (relative to the frame's centre,
/ `SPRITE_SCALE`) and a state (the game's ring), read off a frame by `SpriteNet`; after the crop
`SpriteDecoder` draws it over the cells' view, the same drawing wherever it is. Why (issue 11):
on the canvas the player's pixels move to other cells at every step of the phase, and a model
that otherwise only copies cells lost it within a few frames; here it is three numbers.

Creature layer (`creatures`, tile-aligned mode only): small squares that walk the map (the game's
creatures) are kept out of the cells too. Three more channels per cell, last, say whether a
creature's square starts in that cell and at which pixel of it (`CreatureNet` reads them off a
canvas; `CreatureDecoder` draws a learned bitmap there, on the canvas, before the crop). Why
(issue 41): a creature crosses up to four cells, each of which drew only the part it held whole,
so the round trip kept a third of a creature's pixels and the model lost them within a chunk;
here a creature is one cell's three numbers, and it moves with the map when the anchor does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.actions import FrameLayout
from models.vae import DecoderCache, to_uint8

PHASE_CHANNELS = 4  # tile-aligned latents: cos, sin of the x phase, then of the y phase
SPRITE_CHANNELS = 3  # sprite mode: the sprite's centre x, y from the frame's centre, its state
SPRITE_SCALE = 4.0  # view pixels per unit of the sprite's raw position channels
SPRITE_REACH = 8  # view pixels from its centre within which the sprite is drawn
CREATURE_CHANNELS = 3  # creature layer: per cell, a creature starts here (+-1), where in it (x, y)
CREATURE_SCALE = 2.0  # canvas pixels per unit of a creature's raw offset channels
# A generated cell whose pixels in view vary less than this (std, [-1, 1] units, worst channel)
# is a flat tile to `canonical` and is snapped to the codebook; a cell holding part of a creature
# varies far more (see the model card's snap measurements).
SNAP_STD = 0.1


@dataclass
class FastAEConfig:
    """Shape of the fast autoencoder (stored as vae/config.json beside its weights)."""

    latent_channels: int = 16  # C: channels of a latent frame
    spatial: int = 8  # pixels per latent cell along each axis (a power of two)
    temporal: int = 1  # video frames per latent frame
    first_is_single: bool = False  # the first latent frame of a stream decodes to one video frame
    temporal_kernel: int = 1  # latent frames the decoder sees per output: this one + k-1 before it
    enc_channels: tuple[int, ...] = (16, 32, 64, 96)  # encoder widths, full resolution -> latent res
    dec_channels: tuple[int, ...] = (128, 64, 32, 16)  # decoder widths, latent res -> full resolution
    dec_mid_blocks: int = 1  # residual blocks at latent resolution in the decoder
    dec_up_blocks: tuple[int, ...] = (1, 1, 0)  # residual blocks after each up-step (same order)
    latents_mean: list[float] = field(default_factory=list)  # per channel; [] = 0 (set after training)
    latents_std: list[float] = field(default_factory=list)  # per channel; [] = 1 (set after training)
    frame_size: int = 0  # > 0: tile-aligned latents of frames this many px square (module docstring)
    sprite: bool = False  # tile-aligned mode: one sprite drawn in view coordinates, not in cells
    # tile-aligned mode: creatures (small squares that walk the map) drawn from 3 per-cell channels
    # over the cells, not by them (`CreatureNet`, `CreatureDecoder`)
    creatures: bool = False
    # tile-aligned mode: the flat tile colours (RGB 0-255) that `canonical` snaps to, a codebook
    # fit on training frames (models/tiny_world/training/codebook.py); [] = no snapping
    codebook: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        levels = int(math.log2(self.spatial))
        if 2**levels != self.spatial:
            raise ValueError(f"spatial factor {self.spatial} must be a power of two")
        if len(self.enc_channels) != levels + 1 or len(self.dec_channels) != levels + 1:
            raise ValueError(f"spatial {self.spatial} needs {levels + 1} encoder and decoder widths")
        if len(self.dec_up_blocks) != levels:
            raise ValueError(f"dec_up_blocks needs {levels} entries")
        if self.temporal < 1 or self.temporal_kernel < 1:
            raise ValueError("temporal factor and kernel must be >= 1")
        for name in ("latents_mean", "latents_std"):
            values = getattr(self, name)
            if values and len(values) != self.latent_channels:
                raise ValueError(f"{name} needs {self.latent_channels} values")
        if self.frame_size:
            if self.frame_size % self.spatial or self.temporal != 1 or self.temporal_kernel != 1:
                raise ValueError(
                    "tile-aligned latents need frame_size % spatial == 0 and one frame per latent"
                )
            if self.cell_channels < 1:
                layers = PHASE_CHANNELS + self.sprite_channels + self.creature_channels
                raise ValueError(f"tile-aligned latents need more than {layers} channels")
        elif self.sprite or self.creatures or self.codebook:
            raise ValueError(
                "a sprite or creature layer or a codebook needs tile-aligned latents (frame_size > 0)"
            )
        if any(len(c) != 3 or not all(0 <= v <= 255 for v in c) for c in self.codebook):
            raise ValueError("codebook colours are RGB triples in 0..255")

    @property
    def margin_cells(self) -> int:
        """Latent cells per axis beyond the frame's: the tile-aligned canvas reaches two cells past
        the frame on each side (phases in [-s/2, 3s/2), plus an even grid for 2x2 patches)."""
        return 4 if self.frame_size else 0

    @property
    def canvas_cells(self) -> int:
        """Cells per side of the tile-aligned canvas (0 for plain latents)."""
        return self.frame_size // self.spatial + self.margin_cells if self.frame_size else 0

    @property
    def sprite_channels(self) -> int:
        """Channels of the sprite layer (0 without one)."""
        return SPRITE_CHANNELS if self.sprite else 0

    @property
    def creature_channels(self) -> int:
        """Channels of the creature layer (0 without one)."""
        return CREATURE_CHANNELS if self.creatures else 0

    @property
    def cell_channels(self) -> int:
        """Channels of the encoder's cells (all but the phase, sprite and creature channels in
        tile-aligned mode, which follow the cells in that order)."""
        layers = PHASE_CHANNELS + self.sprite_channels + self.creature_channels
        return self.latent_channels - (layers if self.frame_size else 0)

    @property
    def phase_slice(self) -> slice:
        """Where the phase channels lie in a tile-aligned latent frame."""
        return slice(self.cell_channels, self.cell_channels + PHASE_CHANNELS)

    @property
    def sprite_slice(self) -> slice:
        """Where the sprite channels lie (empty without a sprite layer)."""
        start = self.cell_channels + PHASE_CHANNELS
        return slice(start, start + self.sprite_channels)

    @property
    def creature_slice(self) -> slice:
        """Where the creature channels lie (empty without a creature layer): last."""
        return slice(self.latent_channels - self.creature_channels, self.latent_channels)

    @property
    def layout(self) -> FrameLayout:
        """How latent frames expand into video frames."""
        return FrameLayout(frames_per_latent=self.temporal, first_is_single=self.first_is_single)

    def to_dict(self) -> dict:
        """JSON-ready dict (round-trips through `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FastAEConfig:
        """Inverse of `to_dict` (unknown keys, such as a `_class_name`, are ignored; an older
        directory's "palette", the same list under its former name, is read as the codebook)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        if "palette" in data and "codebook" not in data:
            kwargs["codebook"] = data["palette"]
        for key in ("enc_channels", "dec_channels", "dec_up_blocks"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key])
        return cls(**kwargs)

    @classmethod
    def wan_like(cls) -> FastAEConfig:
        """The shape that would decode full-size Wan2.1 latents (16 ch, 8x spatial, 4x temporal)."""
        return cls(
            latent_channels=16,
            spatial=8,
            temporal=4,
            first_is_single=True,
            temporal_kernel=2,
            enc_channels=(32, 64, 128, 256),
            dec_channels=(256, 128, 64, 32),
            dec_mid_blocks=2,
            dec_up_blocks=(1, 1, 1),
        )


# --- blocks --------------------------------------------------------------------------------------


class ResBlock(nn.Module):
    """x + conv(silu(conv(silu(x)))); the second conv starts at zero, so a new block is identity."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))


class Up(nn.Module):
    """2x upsampling: a 3x3 conv to 4x the output width at low resolution, then pixel shuffle."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, 4 * c_out, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shuffle(self.conv(F.silu(x)))  # (N, c_out, 2h, 2w)


class Encoder(nn.Module):
    """Frames (N, 3, H, W) in [-1, 1] -> per-frame features (N, enc_channels[-1], H/s, W/s)."""

    def __init__(self, cfg: FastAEConfig) -> None:
        super().__init__()
        ch = cfg.enc_channels
        self.conv_in = nn.Conv2d(3, ch[0], 3, padding=1)
        self.down = nn.ModuleList(
            nn.Conv2d(ch[i], ch[i + 1], 3, stride=2, padding=1) for i in range(len(ch) - 1)
        )
        self.res = nn.ModuleList(ResBlock(ch[i + 1]) for i in range(len(ch) - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for down, res in zip(self.down, self.res, strict=True):
            x = res(down(F.silu(x)))
        return F.silu(x)


class Decoder(nn.Module):
    """Latent frames with their temporal context (N, k*C, h, w) -> video (N, 3*temporal, H, W)."""

    def __init__(self, cfg: FastAEConfig) -> None:
        super().__init__()
        ch = cfg.dec_channels
        self.conv_in = nn.Conv2d(cfg.temporal_kernel * cfg.latent_channels, ch[0], 3, padding=1)
        self.mid = nn.Sequential(*(ResBlock(ch[0]) for _ in range(cfg.dec_mid_blocks)))
        self.up = nn.ModuleList(
            nn.Sequential(Up(ch[i], ch[i + 1]), *(ResBlock(ch[i + 1]) for _ in range(cfg.dec_up_blocks[i])))
            for i in range(len(ch) - 1)
        )
        self.conv_out = nn.Conv2d(ch[-1], 3 * cfg.temporal, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.conv_in(z))
        for up in self.up:
            x = up(x)
        return self.conv_out(F.silu(x))


class CellEncoder(nn.Module):
    """Tile-aligned mode: canvas (N, 4, S, S) -> features (N, width, S/s, S/s), each cell from its
    own s x s pixels only (a patchify conv, then per-cell layers), so equal cells encode equally
    wherever they are: a scroll by whole tiles is a copy of cells."""

    def __init__(self, s: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, width, s, stride=s), nn.SiLU(), nn.Conv2d(width, width, 1), nn.SiLU()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CellDecoder(nn.Module):
    """Tile-aligned mode: cells (N, C, h, w) -> canvas (N, 3, h s, w s), each cell's pixels from
    that cell alone (per-cell layers, then pixel shuffle): copied cells draw copied pixels."""

    def __init__(self, channels: int, s: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, width, 1),
            nn.SiLU(),
            nn.Conv2d(width, width, 1),
            nn.SiLU(),
            nn.Conv2d(width, width, 1),
            nn.SiLU(),
            nn.Conv2d(width, 3 * s * s, 1),
            nn.PixelShuffle(s),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class PhaseNet(nn.Module):
    """Frames (N, 3, H, W) in [-1, 1] -> logits (N, 2, s) of the tile grid's phase along x and y.

    Small convs score every pixel as lying just after a vertical (x) or horizontal (y) tile edge;
    the scores are pooled by pixel coordinate modulo the tile side s, so logit k says "edges at
    columns (rows) k, k + s, ...". A frame at sub-tile offset o has its edges at (s - o) mod s.
    """

    def __init__(self, s: int, width: int = 16) -> None:
        super().__init__()
        self.s = s
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, 2, 1),
        )

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        e = self.net(frames)  # (N, 2, H, W)
        n, _, h, w = e.shape
        s = self.s
        lx = e[:, 0].reshape(n, h, w // s, s).sum(dim=(1, 2))  # (N, s) by column mod s
        ly = e[:, 1].reshape(n, h // s, s, w).sum(dim=(1, 3))  # (N, s) by row mod s
        return torch.stack([lx, ly], dim=1)

    def offsets(self, frames: torch.Tensor) -> torch.Tensor:
        """(N, 2) long: each frame's sub-tile offset (x, y) in [0, s)."""
        return (self.s - self(frames).argmax(dim=-1)) % self.s


class SpriteNet(nn.Module):
    """Sprite mode: frames (N, 3, H, W) in [-1, 1] -> logits (N, H*W) of where the sprite's
    centre lies (index y W + x: the centre is pixel (x, y)'s top-left corner) and (N,) logits of
    its state being on. Three 3x3 convs see a 7x7 window, enough to find both edges of a sprite
    up to 6 px across; the state is pooled by a soft maximum (on anywhere in the frame; a hard
    max passes the gradient to one pixel only, and training stalled at "never on")."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, 2, 1),
        )

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.net(frames)  # (N, 2, H, W)
        state = e[:, 1].flatten(1)
        return e[:, 0].flatten(1), torch.logsumexp(state, dim=1) - math.log(state.shape[1])

    def read(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 2) long centres (x, y) in view pixels and (N,) bool states of frames' sprites."""
        heat, state = self(frames)
        w = frames.shape[-1]
        i = heat.argmax(dim=1)
        return torch.stack([i % w, i // w], dim=1), state > 0


class SpriteDecoder(nn.Module):
    """Sprite mode: a learned bitmap per state (opacity logit and colour, 2 `SPRITE_REACH` px
    square) pasted with its centre on the sprite's centre, so the sprite looks the same wherever
    it is and nothing is drawn beyond its reach. (A per-pixel MLP over the offset to the centre
    drew the player but never learned the ring's one-pixel outline.)"""

    # Adam moves a parameter by about its learning rate per step, too little for an opacity logit
    # that must reach +-8 in a short autoencoder run: the bitmaps are stored divided by this.
    gain = 16.0

    def __init__(self, reach: int = SPRITE_REACH) -> None:
        super().__init__()
        self.reach = reach
        self.bitmaps = nn.Parameter(torch.zeros(2, 4, 2 * reach, 2 * reach))

    def forward(self, frames: torch.Tensor, centre: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The sprite drawn over square frames (N, 3, H, H) at centres (N, 2) long (view pixels,
        each in [0, H]) in states (N,) bool."""
        h, r = frames.shape[-1], self.reach
        bm = self.bitmaps[state.long()] * self.gain  # (N, 4, 2r, 2r)
        bm = torch.cat([torch.sigmoid(bm[:, :1]), bm[:, 1:]], dim=1).to(frames.dtype)
        # On a canvas padded by r the bitmap's corner is the centre; zero opacity off the bitmap.
        layer = paste(bm, centre, h + 2 * r)[:, :, r : r + h, r : r + h]
        return frames + layer[:, :1] * (layer[:, 1:] - frames)


class CreatureNet(nn.Module):
    """Creature mode: canvases (N, 4, S, S) (`place`: the frame's pixels and where it lies) ->
    logits (N, g, g, s*s) that a creature's square starts at each pixel of each s x s cell (a
    cell's "none" is a fixed 0 logit). Three 5x5 convs see 6 px on every side, enough to place
    the corner of a creature that the view's edge cuts down to one column."""

    def __init__(self, s: int, width: int = 16) -> None:
        super().__init__()
        self.s = s
        self.net = nn.Sequential(
            nn.Conv2d(4, width, 5, padding=2),
            nn.SiLU(),
            nn.Conv2d(width, width, 5, padding=2),
            nn.SiLU(),
            nn.Conv2d(width, 1, 5, padding=2),
        )

    def forward(self, canvas: torch.Tensor) -> torch.Tensor:
        e = self.net(canvas)[:, 0]  # (N, S, S)
        n, size, s = e.shape[0], e.shape[-1], self.s
        g = size // s
        return e.view(n, g, s, g, s).permute(0, 1, 3, 2, 4).reshape(n, g, g, s * s)

    def read(self, canvas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, g, g) bool: a creature starts in the cell; (N, 2, g, g) long: at which pixel
        (x, y) of it."""
        best, i = self(canvas).max(dim=-1)
        return best > 0, torch.stack([i % self.s, i // self.s], dim=1)


class CreatureDecoder(nn.Module):
    """Creature mode: a learned bitmap (opacity logit and colour, `bitmap` px square) drawn on
    the canvas with its top-left corner where each cell's creature starts, over the cells'
    drawing, so a creature looks the same wherever it is and crosses cells whole. Creatures
    belong to the map, so they are drawn before the crop (the sprite, which belongs to the
    view, after it)."""

    gain = SpriteDecoder.gain  # the bitmaps are stored divided by it, as the sprite's are

    def __init__(self, bitmap: int = 8) -> None:
        super().__init__()
        self.bitmap = nn.Parameter(torch.zeros(4, bitmap, bitmap))

    def forward(self, canvas: torch.Tensor, present: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Canvases (N, 3, S, S) with a creature drawn at every cell where `present` (N, g, g)
        bool, starting at pixel `offsets` (N, 2, g, g) long of the cell."""
        rows, cy, cx = present.nonzero(as_tuple=True)
        if not len(rows):
            return canvas
        n, _, size, _ = canvas.shape
        s, b = size // present.shape[-1], self.bitmap.shape[-1]
        bm = self.bitmap * self.gain
        alpha = torch.sigmoid(bm[:1])
        kernel = torch.cat([alpha, alpha * bm[1:]]).to(canvas.dtype)  # (4, b, b): opacity, colour
        xs = (cx * s + offsets[rows, 0, cy, cx].clamp(0, s - 1)).tolist()
        ys = (cy * s + offsets[rows, 1, cy, cx].clamp(0, s - 1)).tolist()
        # A few creatures a frame: pasting each costs far less than a transposed convolution.
        layer = canvas.new_zeros(n, 4, size + b, size + b)
        for r, x, y in zip(rows.tolist(), xs, ys, strict=True):
            layer[r, :, y : y + b, x : x + b] = layer[r, :, y : y + b, x : x + b] + kernel
        layer = layer[:, :, :size, :size]
        a = layer[:, :1]
        # Two squares overlapping sum their opacities: draw the overlap once, in their mean colour.
        scale = 1.0 / a.clamp(min=1.0)
        return canvas * (1 - a * scale) + layer[:, 1:] * scale


def creature_channels(present: torch.Tensor, offsets: torch.Tensor, s: int) -> torch.Tensor:
    """(N, g, g) bool and (N, 2, g, g) long (`CreatureNet.read`) -> the raw creature channels
    (N, 3, g, g): +-1, then the offset from the cell's middle / CREATURE_SCALE where one starts
    (0 elsewhere)."""
    on = present.to(torch.float32)[:, None]
    pos = (offsets.to(torch.float32) - (s - 1) / 2) / CREATURE_SCALE * on
    return torch.cat([on * 2 - 1, pos], dim=1)


def read_creatures(channels: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw creature channels (N, 3, g, g) -> (N, g, g) bool and (N, 2, g, g) long offsets in
    [0, s), rounded (a generated latent's are never exact)."""
    c = channels.float()
    offsets = torch.round(c[:, 1:] * CREATURE_SCALE + (s - 1) / 2).long().clamp(0, s - 1)
    return c[:, 0] > 0, offsets


def corner_cells(
    corners: torch.Tensor, pos: torch.Tensor, g: int, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where creatures' squares start, (N, K, 2) long (x, y) in view pixels, on canvases of g x g
    cells whose view's top-left corner lies at `pos` (N, 2) -> `CreatureNet.read`'s form. Corners
    off the canvas are left out; of two in one cell, one is kept."""
    px = corners.long() + pos[:, None].long()  # (N, K, 2) canvas pixels
    inside = ((px >= 0) & (px < g * s)).all(dim=-1)  # (N, K)
    rows, k = inside.nonzero(as_tuple=True)
    cell, off = px[rows, k] // s, px[rows, k] % s  # (M, 2) each
    present = torch.zeros(corners.shape[0], g, g, dtype=torch.bool, device=corners.device)
    offsets = torch.zeros(corners.shape[0], 2, g, g, dtype=torch.long, device=corners.device)
    present[rows, cell[:, 1], cell[:, 0]] = True
    offsets[rows, :, cell[:, 1], cell[:, 0]] = off
    return present, offsets


def sprite_channels(
    centre: torch.Tensor, state: torch.Tensor, size: int, hw: tuple[int, int]
) -> torch.Tensor:
    """Sprite centres (N, 2) in view pixels of `size`-px frames and states (N,) bool -> the raw
    sprite channels (N, 3, h, w): the centre's offset from the frame's centre / SPRITE_SCALE,
    then +-1."""
    pos = (centre.to(torch.float32) - size / 2) / SPRITE_SCALE
    vals = torch.cat([pos, state.to(torch.float32)[:, None] * 2 - 1], dim=1)
    return vals[:, :, None, None].expand(-1, -1, *hw)


def read_sprite(channels: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw sprite channels (N, 3, h, w) -> centres (N, 2) long in view pixels, rounded from the
    mean over the cells, and states (N,) bool (a generated latent's are never exact)."""
    m = channels.float().mean(dim=(2, 3))  # (N, 3)
    centre = torch.round(m[:, :2] * SPRITE_SCALE + size / 2).long().clamp(0, size)
    return centre, m[:, 2] > 0


def phase_channels(phase: torch.Tensor, s: int, hw: tuple[int, int]) -> torch.Tensor:
    """Phases (N, 2) in [-s/2, 3s/2) -> the raw phase channels (N, 4, h, w): cos, sin of
    2 pi p / 2s for x, then y."""
    ang = phase.to(torch.float32) * (math.pi / s)
    vals = torch.stack([ang[:, 0].cos(), ang[:, 0].sin(), ang[:, 1].cos(), ang[:, 1].sin()], dim=1)
    return vals[:, :, None, None].expand(-1, -1, *hw)


def read_phase(channels: torch.Tensor, s: int) -> torch.Tensor:
    """Raw phase channels (N, 4, h, w) -> phases (N, 2) long in [-s/2, 3s/2): the nearest of the
    2s phases to the angle of each axis' mean (cos, sin) over the cells (a generated latent's are
    never exact)."""
    m = channels.float().mean(dim=(2, 3))  # (N, 4)
    ang = torch.atan2(m[:, 1::2], m[:, 0::2])  # (N, 2)
    p = torch.round(ang * (s / math.pi)).long() % (2 * s)
    return torch.where(p >= 3 * s // 2, p - 2 * s, p)


def paste(x: torch.Tensor, pos: torch.Tensor, canvas: int) -> torch.Tensor:
    """Images (N, C, H, W) put on a zero canvas (N, C, canvas, canvas) with their top-left
    corners at `pos` (N, 2) (x, y)."""
    n, c, h, w = x.shape
    out = x.new_zeros(n, c, canvas, canvas)
    for px, py in pos.unique(dim=0).tolist():
        rows = ((pos[:, 0] == px) & (pos[:, 1] == py)).nonzero()[:, 0]
        out[rows, :, py : py + h, px : px + w] = x[rows]
    return out


def place(frames: torch.Tensor, pos: torch.Tensor, canvas: int) -> torch.Tensor:
    """Frames (N, 3, H, W) put on a zero canvas (N, 4, canvas, canvas) with their top-left
    corners at `pos` (N, 2) (x, y), with a 4th channel that is 1 where the frame is."""
    n, _, h, w = frames.shape
    return paste(torch.cat([frames, frames.new_ones(n, 1, h, w)], dim=1), pos, canvas)


def crop(canvas: torch.Tensor, pos: torch.Tensor, size: int) -> torch.Tensor:
    """The (N, C, size, size) windows of canvases (N, C, S, S) whose top-left corners are `pos`
    (N, 2) (x, y)."""
    out = canvas.new_empty(canvas.shape[0], canvas.shape[1], size, size)
    for px, py in pos.unique(dim=0).tolist():
        rows = ((pos[:, 0] == px) & (pos[:, 1] == py)).nonzero()[:, 0]
        out[rows] = canvas[rows, :, py : py + size, px : px + size]
    return out


def flat_in_view(pixels: torch.Tensor, cover: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Canvases (N, 3, S, S) in [-1, 1] seen through `cover` (N, 1, S, S) -> per s x s cell
    (N, 1, g, g) bool: the cell shows pixels and they are flat (every colour's std under
    `SNAP_STD`), and the mean colour of those pixels (N, 3, g, g)."""
    pixels = pixels * cover
    count = F.avg_pool2d(cover, s) * s * s  # (N, 1, g, g) view pixels per cell
    mean = F.avg_pool2d(pixels, s) * s * s / count.clamp(min=1)
    var = F.avg_pool2d(pixels.square(), s) * s * s / count.clamp(min=1) - mean.square()
    return (count > 0) & (var.clamp(min=0).sqrt().amax(dim=1, keepdim=True) < SNAP_STD), mean


def shift_cells(cells: torch.Tensor, d: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Cells (N, C, h, w) of canvases moved by d (N, 2) (x, y) cells in {-1, 0, 1} (the anchor
    moves d tiles, so cell i becomes cell i - d); vacated cells take `fill` (C, 1, 1)."""
    out = fill.expand_as(cells).clone()
    h, w = cells.shape[-2:]
    for dx, dy in d.unique(dim=0).tolist():
        rows = ((d[:, 0] == dx) & (d[:, 1] == dy)).nonzero()[:, 0]
        src = cells[rows, :, max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)]
        out[rows, :, max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)] = src
    return out


# --- the autoencoder -----------------------------------------------------------------------------


class FastAutoencoder(nn.Module):
    """Encoder + causal decoder over normalised latents; float tensors in and out (for training).

    Latents are normalised per channel like Wan's: ``z = (z_raw - mean) / std`` with the
    config's `latents_mean` / `latents_std` (kept as buffers so they travel with the weights).
    """

    def __init__(self, cfg: FastAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c, t = cfg.latent_channels, cfg.temporal
        tiled = bool(cfg.frame_size)
        self.encoder = CellEncoder(cfg.spatial, cfg.enc_channels[-1]) if tiled else Encoder(cfg)
        self.quant = nn.Conv2d(t * cfg.enc_channels[-1], cfg.cell_channels, 1)
        self.decoder = (
            CellDecoder(cfg.cell_channels, cfg.spatial, cfg.dec_channels[0]) if tiled else Decoder(cfg)
        )
        self.phase = PhaseNet(cfg.spatial) if tiled else None
        self.sprite_net = SpriteNet() if cfg.sprite else None
        self.sprite_decoder = SpriteDecoder() if cfg.sprite else None
        self.creature_net = CreatureNet(cfg.spatial) if cfg.creatures else None
        self.creature_decoder = CreatureDecoder(cfg.spatial) if cfg.creatures else None
        mean = cfg.latents_mean or [0.0] * c
        std = cfg.latents_std or [1.0] * c
        self.register_buffer("latents_mean", torch.tensor(mean).view(c, 1, 1, 1))
        self.register_buffer("latents_std", torch.tensor(std).view(c, 1, 1, 1))

    def set_normalisation(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Set the per-channel latent statistics (C,) and record them in the config."""
        self.latents_mean.copy_(mean.view_as(self.latents_mean))
        self.latents_std.copy_(std.view_as(self.latents_std))
        self.cfg.latents_mean = [float(v) for v in mean.flatten()]
        self.cfg.latents_std = [float(v) for v in std.flatten()]

    def encode_raw(
        self,
        video: torch.Tensor,
        offsets: torch.Tensor | None = None,
        sprites: torch.Tensor | None = None,
        creatures: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """video (B, 3, T, H, W) in [-1, 1] -> raw latents (B, C, n, h, w), n = latent frames of T.

        Tile-aligned mode: `offsets` (B, T, 2) are the frames' sub-tile offsets when known (the
        simulator's camera modulo the tile); None reads them off the frames (`PhaseNet`). With a
        sprite layer, `sprites` (B, T, 3) are the sprites' centres (x, y) in view pixels and
        states (0/1) when known; None reads them (`SpriteNet`). With a creature layer,
        `creatures` (B, T, K, 2) are where each creature's square starts, in view pixels, when
        known (creatures off the canvas are left out); None reads them (`CreatureNet`).
        """
        cfg = self.cfg
        if cfg.frame_size:
            return self._encode_tiled(video, offsets, sprites, creatures)
        b, _, t_len, hh, ww = video.shape
        tf = cfg.temporal
        if tf > 1:
            if cfg.first_is_single:
                video = torch.cat([video[:, :, :1].expand(-1, -1, tf - 1, -1, -1), video], dim=2)
            if video.shape[2] % tf:
                raise ValueError(f"{t_len} frames do not fill whole latent frames of {tf}")
        frames = video.transpose(1, 2).reshape(-1, 3, hh, ww)  # (B*T', 3, H, W)
        feats = self.encoder(frames)
        _, cf, h, w = feats.shape
        n = feats.shape[0] // (b * tf)
        feats = feats.view(b * n, tf * cf, h, w)  # a latent frame's video frames side by side in channels
        z = self.quant(feats).view(b, n, -1, h, w)  # (B, n, C, h, w)
        return z.transpose(1, 2)  # (B, C, n, h, w)

    def _encode_tiled(
        self,
        video: torch.Tensor,
        offsets: torch.Tensor | None,
        sprites: torch.Tensor | None,
        creatures: torch.Tensor | None,
    ) -> torch.Tensor:
        cfg = self.cfg
        b, _, t_len, hh, ww = video.shape
        frames = video.transpose(1, 2).reshape(-1, 3, hh, ww)  # (B*T, 3, H, W)
        off = self.phase.offsets(frames) if offsets is None else offsets.reshape(-1, 2).long()
        g, s = cfg.canvas_cells, cfg.spatial
        canvas = self._canvas(frames, off + 2 * s, g)
        cells = self.quant(self.encoder(canvas))
        parts = [cells, phase_channels(off, s, (g, g)).to(cells.dtype)]
        if cfg.sprite:
            parts.append(self._sprite_raw(frames, sprites, (g, g)).to(cells.dtype))
        if cfg.creatures:
            corners = None if creatures is None else creatures.reshape(frames.shape[0], -1, 2)
            parts.append(self._creature_raw(canvas, off + 2 * s, corners).to(cells.dtype))
        z = torch.cat(parts, dim=1)
        return z.view(b, t_len, -1, g, g).transpose(1, 2)

    def _sprite_raw(
        self, frames: torch.Tensor, sprites: torch.Tensor | None, hw: tuple[int, int]
    ) -> torch.Tensor:
        """Raw sprite channels (N, 3, h, w) of frames (N, 3, H, W): from `sprites` (..., 3) when
        given, else read off the frames."""
        if sprites is None:
            centre, state = self.sprite_net.read(frames)
        else:
            flat = sprites.reshape(-1, 3).long()
            centre, state = flat[:, :2], flat[:, 2] > 0
        return sprite_channels(centre, state, self.cfg.frame_size, hw)

    def _creature_raw(
        self, canvas: torch.Tensor, pos: torch.Tensor, corners: torch.Tensor | None
    ) -> torch.Tensor:
        """Raw creature channels (N, 3, g, g) of canvases (N, 4, S, S) (`_canvas`) whose view's
        top-left corner lies at `pos` (N, 2): from `corners` (N, K, 2) when given, else read off
        the canvases."""
        s = self.cfg.spatial
        if corners is None:
            present, offsets = self.creature_net.read(canvas)
        else:
            present, offsets = corner_cells(corners, pos, canvas.shape[-1] // s, s)
        return creature_channels(present, offsets, s)

    def _canvas(self, frames: torch.Tensor, pos: torch.Tensor, g: int) -> torch.Tensor:
        """Frames (N, 3, H, W) placed on canvases of g x g cells at `pos` (`place`); ValueError
        for frames of another size."""
        cfg = self.cfg
        if (frames.shape[-2], frames.shape[-1]) != (cfg.frame_size, cfg.frame_size):
            raise ValueError(
                f"frames are {tuple(frames.shape[-2:])}; this autoencoder is for {cfg.frame_size} square"
            )
        return place(frames, pos, g * cfg.spatial)

    def fill_cell(self) -> torch.Tensor:
        """Raw cell latents (cell_channels, 1, 1) of a cell no frame pixel falls in (the canvas'
        far margin)."""
        s = self.cfg.spatial
        p = self.latents_std
        return self.quant(self.encoder(torch.zeros(1, 4, s, s, device=p.device, dtype=p.dtype)))[0]

    def encode_wide(
        self,
        frames: torch.Tensor,
        offsets: torch.Tensor,
        sprites: torch.Tensor | None = None,
        creatures: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Frames (N, 3, H, W) in [-1, 1] at sub-tile offsets (N, 2) -> normalised cells
        (N, C-4, g+2, g+2) of their own anchor's canvas grown by a cell on every side (the sprite
        and creature channels after the cells, `sprites` and `creatures` (N, K, 2) as in
        `encode_raw`), from which `at_anchor` cuts the frame's latents on a neighbouring anchor."""
        cfg = self.cfg
        g = cfg.canvas_cells + 2
        pos = offsets.long() + 3 * cfg.spatial
        canvas = self._canvas(frames, pos, g)
        cells = self.quant(self.encoder(canvas))
        parts = [cells]
        if cfg.sprite:
            parts.append(self._sprite_raw(frames, sprites, (g, g)).to(cells.dtype))
        if cfg.creatures:
            parts.append(self._creature_raw(canvas, pos, creatures).to(cells.dtype))
        k = cfg.cell_channels
        mean = torch.cat([self.latents_mean[:k], self.latents_mean[cfg.phase_slice.stop :]])[:, 0]
        std = torch.cat([self.latents_std[:k], self.latents_std[cfg.phase_slice.stop :]])[:, 0]
        return (torch.cat(parts, dim=1) - mean) / std  # all but the phase's

    def at_anchor(self, wide: torch.Tensor, offsets: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """Normalised latents (N, C, g, g) of frames (`encode_wide` cells (N, C-4, g+2, g+2), their
        sub-tile offsets (N, 2)) drawn on the anchor d (N, 2) tiles before their own (d in
        {-1, 0, 1}: the frame's phase is offset + d s)."""
        cfg = self.cfg
        g, s, k, ph = cfg.canvas_cells, cfg.spatial, cfg.cell_channels, cfg.phase_slice
        window = crop(wide, 1 - d, g)  # a cell window, not pixels: the same cutting
        raw = phase_channels(offsets.long() + s * d, s, (g, g)).to(wide.dtype)
        phase = (raw - self.latents_mean[ph, 0]) / self.latents_std[ph, 0]
        return torch.cat([window[:, :k], phase, window[:, k:]], dim=1)

    def canonical(self, z: torch.Tensor) -> torch.Tensor:
        """A generated chunk (normalised latents (B, C, n, h, w)) as it enters the history: moved
        onto the anchor of its own last frame (whole cells shifted, the vacated far-margin cells
        filled as `fill_cell`), phases set exactly to what they read as (the decoder crops there),
        so it decodes to the same frames; with a codebook, flat cells snapped to it (`snap_cells`).
        Plain latents are returned as they are."""
        cfg = self.cfg
        if not cfg.frame_size:
            return z
        b, _, n, h, w = z.shape
        k, s, ph, sp = cfg.cell_channels, cfg.spatial, cfg.phase_slice, cfg.sprite_slice
        mean, std = self.latents_mean[:, 0], self.latents_std[:, 0]  # (C, 1, 1)
        flat = z.transpose(1, 2).reshape(b * n, -1, h, w)
        phase = self.read_phases(flat)  # (B*n, 2)
        d = self.anchor_moves(z).repeat_interleave(n, dim=0)
        fill = (self.fill_cell() - mean[:k]) / std[:k]
        cells = shift_cells(flat[:, :k], d, fill)
        extra = []
        if cfg.creatures:
            # Creatures belong to the map: their cells move with the anchor like the terrain's.
            cs = cfg.creature_slice
            none = (z.new_tensor([-1.0, 0.0, 0.0]).view(3, 1, 1) - mean[cs]) / std[cs]  # no creature
            moved = shift_cells(flat[:, cs], d, none) * std[cs] + mean[cs]
            raw = creature_channels(*read_creatures(moved, s), s).to(z.dtype)
            extra.append((raw - mean[cs]) / std[cs])
        if cfg.codebook:
            raw = self.snap_cells(cells * std[:k] + mean[:k], phase - s * d + 2 * s)
            cells = (raw - mean[:k]) / std[:k]
        parts = [cells, (phase_channels(phase - s * d, s, (h, w)).to(z.dtype) - mean[ph]) / std[ph]]
        if cfg.sprite:
            centre, state = read_sprite(flat[:, sp] * std[sp] + mean[sp], cfg.frame_size)
            raw = sprite_channels(centre, state, cfg.frame_size, (h, w)).to(z.dtype)
            parts.append((raw - mean[sp]) / std[sp])
        return torch.cat(parts + extra, dim=1).view(b, n, -1, h, w).transpose(1, 2)

    def read_phases(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latent frames (N, C, h, w) -> where each view lies on its canvas (N, 2) long
        (x, y) px in [-s/2, 3s/2), as the decoder reads it (`read_phase`)."""
        ph = self.cfg.phase_slice
        return read_phase(z[:, ph] * self.latents_std[ph, 0] + self.latents_mean[ph, 0], self.cfg.spatial)

    def anchor_moves(self, z: torch.Tensor) -> torch.Tensor:
        """Generated chunks (B, C, n, h, w) -> the tiles (B, 2) `canonical` moves each one's anchor:
        onto its last frame's, whole tiles of that frame's phase."""
        return torch.div(self.read_phases(z[:, :, -1]), self.cfg.spatial, rounding_mode="floor")

    def snap_cells(self, cells: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Raw cells (N, k, g, g) of canvases whose view's top-left corner lies at `pos` (N, 2) ->
        the same, with every cell whose pixels in view are flat (std under `SNAP_STD`) replaced by
        the code of a cell of the nearest codebook colour, as the encoder writes it for that view.

        Why (issue 11): the training frames' terrain is flat tiles of a few colours, but the
        model's guess for a cell it cannot know (terrain scrolling into view) is their mean, a
        grey-blue that then spreads through its history. Snapped, every guess is a tile of the
        codebook fit on those frames; cells that hold part of a creature are not flat and are left
        as they are."""
        s = self.cfg.spatial
        cover = self.view_cover(pos, cells.shape[-1])
        flat, mean = self.flat_cells(cells, cover)
        book = torch.tensor(self.cfg.codebook, dtype=cells.dtype, device=cells.device) / 127.5 - 1  # (K, 3)
        tile = book[self.codebook_index(mean)].permute(0, 3, 1, 2)  # (N, 3, g, g)
        snapped = self.encode_seen(F.interpolate(tile, scale_factor=s, mode="nearest"), cover)
        return torch.where(flat, snapped, cells)

    def codebook_index(self, colour: torch.Tensor) -> torch.Tensor:
        """Mean colours (N, 3, g, g) in [-1, 1] (`flat_cells`) -> the nearest codebook entry's
        index (N, g, g) long."""
        book = torch.tensor(self.cfg.codebook, dtype=colour.dtype, device=colour.device) / 127.5 - 1
        return (colour.permute(0, 2, 3, 1)[..., None, :] - book).square().sum(-1).argmin(-1)

    def view_cover(self, pos: torch.Tensor, g: int) -> torch.Tensor:
        """(N, 1, S, S) canvases of g x g cells, 1 where a view whose top-left corner lies at
        `pos` (N, 2) (x, y) shows the canvas (a comparison per pixel: no host sync)."""
        s, f = self.cfg.spatial, self.cfg.frame_size
        px = torch.arange(g * s, device=pos.device)
        inside = (px >= pos[..., None]) & (px < pos[..., None] + f)  # (N, 2, S)
        return (inside[:, 1, :, None] & inside[:, 0, None, :])[:, None].to(self.latents_std.dtype)

    def flat_cells(self, cells: torch.Tensor, cover: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw cells (N, k, g, g) seen through `cover` (`view_cover`) -> (N, 1, g, g) bool: the
        cell shows pixels and they are flat (every colour's std under `SNAP_STD`: a terrain tile,
        not part of a creature), and the mean colour of those pixels (N, 3, g, g) in [-1, 1]."""
        return flat_in_view(self.decoder(cells).clamp(-1, 1), cover, self.cfg.spatial)

    def encode_seen(self, pixels: torch.Tensor, cover: torch.Tensor) -> torch.Tensor:
        """Canvas pixels (N, 3, S, S) in [-1, 1] seen through `cover` (N, 1, S, S) -> raw cells
        (N, k, g, g) as the encoder writes them for that view (each cell from its own pixels)."""
        return self.quant(self.encoder(torch.cat([pixels * cover, cover], dim=1)))

    def encode_float(
        self,
        video: torch.Tensor,
        offsets: torch.Tensor | None = None,
        sprites: torch.Tensor | None = None,
        creatures: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """video (B, 3, T, H, W) in [-1, 1] -> normalised latents (B, C, n, h, w) (`offsets`,
        `sprites`, `creatures`: see `encode_raw`)."""
        raw = self.encode_raw(video, offsets, sprites, creatures)
        return (raw - self.latents_mean) / self.latents_std

    def decode_raw(
        self, z: torch.Tensor, history: torch.Tensor | None = None, first: bool = True
    ) -> torch.Tensor:
        """Raw latents (B, C, n, h, w) -> video (B, 3, T, H, W) in [-1, 1] (not clamped).

        `history` (B, C, k-1, h, w) holds the raw latent frames before `z` (None: the stream starts
        here, zeros stand in); `first` says whether z[:, :, 0] is the stream's first latent frame.
        """
        cfg = self.cfg
        k, tf = cfg.temporal_kernel, cfg.temporal
        b, c, n, h, w = z.shape
        if cfg.frame_size:
            frames = self.decode_layers(z.transpose(1, 2).reshape(b * n, c, h, w))[1]
            return frames.view(b, n, 3, cfg.frame_size, cfg.frame_size).transpose(1, 2)
        if k > 1:
            if history is None:
                history = z.new_zeros(b, c, k - 1, h, w)
            full = torch.cat([history, z], dim=2)  # (B, C, k-1+n, h, w)
            ctx = torch.stack([full[:, :, i : i + n] for i in range(k)], dim=2)  # (B, C, k, n, h, w)
            x = ctx.permute(0, 3, 2, 1, 4, 5).reshape(b * n, k * c, h, w)  # oldest frame first
        else:
            x = z.transpose(1, 2).reshape(b * n, c, h, w)
        out = self.decoder(x)  # (B*n, 3*tf, H, W)
        hh, ww = out.shape[-2:]
        video = out.view(b, n * tf, 3, hh, ww).transpose(1, 2)  # (B, 3, n*tf, H, W)
        if first and cfg.first_is_single and tf > 1:
            video = video[:, :, tf - 1 :]  # the first latent frame keeps only its last video frame
        return video

    def decode_layers(self, flat: torch.Tensor, creatures: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Tile-aligned mode: raw latent frames (N, C, h, w) -> the view of the cells (and the
        creatures over them; `creatures` False: the cells alone) and the frames with the sprite
        drawn over that, (N, 3, H, W) each in [-1, 1] (not clamped; without a sprite layer the
        two are the same)."""
        cfg = self.cfg
        canvas = self.decoder(flat[:, : cfg.cell_channels])  # (N, 3, S, S)
        if cfg.creatures and creatures:
            canvas = self.creature_decoder(canvas, *read_creatures(flat[:, cfg.creature_slice], cfg.spatial))
        pos = read_phase(flat[:, cfg.phase_slice], cfg.spatial) + 2 * cfg.spatial
        backdrop = crop(canvas, pos, cfg.frame_size)
        if not cfg.sprite:
            return backdrop, backdrop
        centre, state = read_sprite(flat[:, cfg.sprite_slice], cfg.frame_size)
        return backdrop, self.sprite_decoder(backdrop, centre, state)

    def decode_float(
        self, z: torch.Tensor, history: torch.Tensor | None = None, first: bool = True
    ) -> torch.Tensor:
        """Normalised latents (B, C, n, h, w) -> video (B, 3, T, H, W) in [-1, 1] (not clamped).

        `history` is in normalised units too.
        """
        raw = z * self.latents_std + self.latents_mean
        hist = None if history is None else history * self.latents_std + self.latents_mean
        return self.decode_raw(raw, hist, first)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        """Reconstruction of video (B, 3, T, H, W) in [-1, 1]."""
        return self.decode_float(self.encode_float(video))


class FastStreamingDecoder:
    """`StreamingDecoder` over a `FastAutoencoder`: the cache is the last k-1 raw latent frames.

    `decode(latents, cache)` returns a new cache and never mutates the one passed in (the cache
    only ever holds fresh tensors, built by slicing and concatenation).
    """

    def __init__(self, ae: FastAutoencoder) -> None:
        self.ae = ae.eval()
        self.layout = ae.cfg.layout
        self.spatial = ae.cfg.spatial
        self.margin_cells = ae.cfg.margin_cells

    @property
    def latent_channels(self) -> int:
        """Channels of a latent frame."""
        return self.ae.cfg.latent_channels

    def init_cache(self) -> DecoderCache:
        """The cache of a stream that has decoded nothing yet."""
        return DecoderCache(feats=(), frames=0)

    @torch.no_grad()
    def canonical(self, latents: torch.Tensor) -> torch.Tensor:
        """Generated latents (B, C, n, h, w) as they enter the history (`FastAutoencoder.canonical`)."""
        p = self.ae.latents_std
        return self.ae.canonical(latents.to(p.device, p.dtype)).to(latents.dtype)

    @torch.no_grad()
    def decode_float(self, latents: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) normalised -> video (3, T, H, W) in [-1, 1] and the advanced cache."""
        ae = self.ae
        k = ae.cfg.temporal_kernel
        z = latents.to(ae.latents_std.device, ae.latents_std.dtype)[None]  # (1, C, n, h, w)
        raw = z * ae.latents_std + ae.latents_mean
        history = cache.feats[0] if cache.feats else None  # raw latents (1, C, k-1, h, w)
        video = ae.decode_raw(raw, history, first=cache.frames == 0)[0].clamp(-1, 1)
        feats: tuple = ()
        if k > 1:
            prev = history if history is not None else raw.new_zeros(*raw.shape[:2], k - 1, *raw.shape[3:])
            feats = (torch.cat([prev, raw], dim=2)[:, :, -(k - 1) :].clone(),)  # (1, C, k-1, h, w)
        return video, DecoderCache(feats=feats, frames=cache.frames + z.shape[2])

    def decode(self, latents: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]:
        """latents (C, n, h, w) -> frames (T, H, W, 3) uint8 and the advanced cache."""
        video, new = self.decode_float(latents, cache)
        return to_uint8(video), new

    @torch.no_grad()
    def decode_batch(
        self, latents: Sequence[torch.Tensor], caches: Sequence[DecoderCache]
    ) -> tuple[list[torch.Tensor], list[DecoderCache]]:
        """Many sessions at once (see `models.vae.decode_batch`): sessions with the same chunk
        length and stream phase decode in one forward; each result equals `decode` alone."""
        ae = self.ae
        k = ae.cfg.temporal_kernel
        frames: list[torch.Tensor] = [torch.empty(0)] * len(latents)
        new: list[DecoderCache] = [self.init_cache()] * len(latents)
        groups: dict[tuple[int, bool], list[int]] = {}
        for b, (z, c) in enumerate(zip(latents, caches, strict=True)):
            groups.setdefault((z.shape[1], c.frames == 0), []).append(b)
        for (n, first), idx in groups.items():
            z = torch.stack([latents[b] for b in idx]).to(ae.latents_std.device, ae.latents_std.dtype)
            raw = z * ae.latents_std + ae.latents_mean  # (G, C, n, h, w)
            history = None
            if k > 1:
                zeros = raw.new_zeros(1, raw.shape[1], k - 1, *raw.shape[3:])
                history = torch.cat([caches[b].feats[0] if caches[b].feats else zeros for b in idx])
            video = ae.decode_raw(raw, history, first=first).clamp(-1, 1)  # (G, 3, T, H, W)
            out = ((video + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous()
            tail = torch.cat([history, raw], dim=2)[:, :, -(k - 1) :] if history is not None else None
            for j, b in enumerate(idx):
                frames[b] = out[j]
                feats = () if tail is None else (tail[j : j + 1].clone(),)
                new[b] = DecoderCache(feats=feats, frames=caches[b].frames + n)
        return frames, new

    @torch.no_grad()
    def encode(self, frames: np.ndarray) -> torch.Tensor:
        """frames (T, H, W, 3) uint8 -> normalised latents (C, n, h, w)."""
        p = self.ae.latents_std
        x = torch.from_numpy(np.ascontiguousarray(frames)).to(p.device, p.dtype)
        x = (x / 127.5 - 1.0).permute(3, 0, 1, 2)[None]  # (1, 3, T, H, W)
        return self.ae.encode_float(x)[0]

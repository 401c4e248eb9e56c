"""The self-forced stages' targets and masks: the model's own world shifted by the game's camera
(`own_world_targets`, `snap_to_tiles`), the game's frames anchored where the model's world is
(`match_shift`, `chunk_anchors`), and the latent pixels a clip may be supervised on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from models.game import GameConfig
from models.tiny_world.fast_decoder import FastAutoencoder

# Anchored targets (`sf_target` "anchor"): how far (frame pixels) the model's view may have
# drifted from the game's and still be found, and how well it must match the game's terrain
# there (PSNR, dB) to be trained on; below it the model's world no longer is the game's map.
ANCHOR_MARGIN = 24


ANCHOR_MIN_PSNR = 15.0


def seen_latent_mask(cameras: torch.Tensor, size: int, patch: int) -> torch.Tensor:
    """Which latent pixels of every clip frame show only ground the clip's start frame showed.

    `cameras` (B, F, 2) is the view's top-left corner (x, y) in frame pixels for the clip's
    frames; frame pixel p of frame j shows what pixel p + camera_j - camera_0 of frame 0 shows,
    so it was seen iff that pixel lies inside [0, size)^2. A latent pixel covers a `patch` x
    `patch` block of frame pixels and counts as seen iff all of them were. Returns (B, F, h, w)
    float32 of 0/1 with h = w = size // patch (frame 0 is all ones)."""
    d = cameras - cameras[:, :1]  # (B, F, 2) shift relative to the start frame
    lo = torch.arange(0, size, patch, dtype=torch.float32)  # first pixel of each latent row/column
    inside = (lo + d[..., None] >= 0) & (lo + patch + d[..., None] <= size)  # (B, F, 2, n)
    return (inside[:, :, 1, :, None] & inside[:, :, 0, None, :]).float()


def own_world_targets(
    last: torch.Tensor,
    shifts: torch.Tensor,
    last_player: torch.Tensor,
    players: torch.Tensor,
    player_size: float,
    grid: TileGrid | None = None,
    camera: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target frames in the model's own world: its latest frame moved as the game's camera moves.

    `last` (B, 3, H, W) in [-1, 1] is the model's latest frame, `shifts` (B, T, 2) the game's
    camera of each target frame minus its camera at `last` (x, y, frame pixels; rounded),
    `last_player` (B, 2) and `players` (B, T, 2) the game's player centre on screen at `last` and
    at each target frame. The sprite is erased from `last` (its box, 1 px wider for the model's
    blur, filled with the pixel row just above it, or below at the top edge), the result shifted
    (target pixel p shows pixel p + shift of `last`), the pixels it does not cover set to 0
    and marked invalid, and a `player_size` magenta square painted at each target's player
    position (pixels whose centres lie in it, as the game draws it). With `grid` and `camera`
    (B, 2) (the game's view corner at `last`), `last` is first redrawn crisply on the game's
    tile grid (`snap_to_tiles`, which also removes the sprite) instead of the box erase.
    Returns (frames (B, 3, T, H, W), valid (B, T, H, W) bool)."""
    b, _, h, w = last.shape
    t = shifts.shape[1]
    half = player_size / 2.0
    if grid is not None:
        clean = snap_to_tiles(last, camera, grid)
    else:
        clean = last.clone()
        for i in range(b):
            (px, py) = last_player[i].tolist()
            x0, x1 = max(math.ceil(px - half - 1.5), 0), min(math.ceil(px + half + 0.5), w)
            y0, y1 = max(math.ceil(py - half - 1.5), 0), min(math.ceil(py + half + 0.5), h)
            if x0 < x1 and y0 < y1:
                src = y0 - 1 if y0 > 0 else min(y1, h - 1)
                clean[i, :, y0:y1, x0:x1] = clean[i, :, src : src + 1, x0:x1]
    d = shifts.round().long()  # (B, T, 2)
    xs = torch.arange(w)[None, None] + d[..., :1]  # (B, T, W)
    ys = torch.arange(h)[None, None] + d[..., 1:]  # (B, T, H)
    valid = ((ys >= 0) & (ys < h))[..., :, None] & ((xs >= 0) & (xs < w))[..., None, :]  # (B, T, H, W)
    pix = clean.permute(0, 2, 3, 1)  # (B, H, W, 3)
    bi = torch.arange(b)[:, None, None, None]
    frames = pix[bi, ys.clamp(0, h - 1)[..., :, None], xs.clamp(0, w - 1)[..., None, :]]  # (B, T, H, W, 3)
    frames = frames * valid[..., None]
    magenta = torch.tensor([1.0, -1.0, 1.0])
    for i in range(b):
        for j in range(t):
            px, py = players[i, j].tolist()
            x0, x1 = max(math.ceil(px - half - 0.5), 0), min(math.ceil(px + half - 0.5), w)
            y0, y1 = max(math.ceil(py - half - 0.5), 0), min(math.ceil(py + half - 0.5), h)
            frames[i, j, y0:y1, x0:x1] = magenta
    return frames.permute(0, 4, 1, 2, 3), valid


def frames_of(video: torch.Tensor) -> torch.Tensor:
    """Decoded video (B, 3, T, H, W) as a batch of frames (B*T, 3, H, W), clamped to [-1, 1]."""
    return video.transpose(1, 2).flatten(0, 1).clamp(-1.0, 1.0)


def match_shift(frame: torch.Tensor, terrain: torch.Tensor, margin: int) -> tuple[int, int, float]:
    """Where `frame` (3, H, W) in [-1, 1] sits in `terrain` (3, H + 2 margin, W + 2 margin), the
    game's terrain around its view: the shift (dx, dy) in frame pixels of the view that `frame`
    shows best (least squared error) relative to the game's, and that error's PSNR (dB, peak 2)."""
    h, w = frame.shape[1:]
    cross = torch.nn.functional.conv2d(terrain[None], frame[None])[0, 0]  # (2m+1, 2m+1)
    box = torch.nn.functional.avg_pool2d(terrain.pow(2).sum(0)[None, None], (h, w), stride=1)[0, 0] * (h * w)
    sse = frame.pow(2).sum() - 2.0 * cross + box
    k = int(sse.argmin())
    dy, dx = divmod(k, sse.shape[1])
    mse = float(sse.flatten()[k].clamp_min(1e-8)) / frame.numel()
    return dx - margin, dy - margin, 10.0 * math.log10(4.0 / mse)


@dataclass(frozen=True)
class TileGrid:
    """The game's drawing rules that a crisp own-world target keeps: square tiles of `tile`
    frame pixels, each one flat shade of `shades` (K, 3) in [-1, 1]."""

    tile: float
    shades: torch.Tensor

    @classmethod
    def of(cls, config: GameConfig) -> TileGrid:
        """The terrain grid and the eight terrain shades of a game config."""
        shades = torch.from_numpy(config.palette.terrain().reshape(-1, 3).astype(np.float32))
        return cls(tile=config.tile * config.scale, shades=shades / 127.5 - 1.0)


def snap_to_tiles(frames: torch.Tensor, camera: torch.Tensor, grid: TileGrid) -> torch.Tensor:
    """Redraw frames (B, 3, H, W) in [-1, 1] as flat tiles: every tile of the game's grid (its
    phase from `camera` (B, 2), the view's top-left corner in frame pixels) takes the shade its
    pixels vote for most, each pixel voting for its nearest shade. Pixels far from every shade
    (sprites, creatures, the space ring) vote only where a tile has no other pixel, so the
    result is terrain alone; blur between two tiles only moves a few boundary votes."""
    b, _, h, w = frames.shape
    k = grid.shades.shape[0]
    pix = frames.permute(0, 2, 3, 1)  # (B, H, W, 3)
    dist = (pix[..., None, :] - grid.shades).pow(2).sum(-1)  # (B, H, W, K)
    near, vote = dist.min(dim=-1)
    weight = torch.where(near < 0.1, 1.0, 1e-3)  # 0.1: ~23 levels RMS per channel from a shade

    def cells(cam: torch.Tensor, n: int) -> torch.Tensor:  # (B, n) tile index of each pixel, from 0
        first = torch.floor((cam[:, None] + torch.arange(n) + 0.5) / grid.tile)
        return (first - first[:, :1]).long()

    cy, cx = cells(camera[:, 1], h), cells(camera[:, 0], w)  # (B, H), (B, W)
    ny, nx = int(cy.max()) + 1, int(cx.max()) + 1
    cell = cy[:, :, None] * nx + cx[:, None, :]  # (B, H, W)
    votes = torch.zeros(b, ny * nx * k)
    votes.scatter_add_(1, (cell * k + vote).view(b, -1), weight.view(b, -1))
    shade = votes.view(b, ny * nx, k).argmax(-1)  # (B, cells)
    return grid.shades[shade.gather(1, cell.view(b, -1))].view(b, h, w, 3).permute(0, 3, 1, 2)


def chunk_anchors(
    cameras: torch.Tensor, chunk: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the frames of clips (cameras (B, F, 2), frame pixels; F = 1 + whole chunks) lie for
    tile-aligned latents (`FastAutoencoder.canonical`): their sub-tile offsets q (B, F, 2), and how
    many tiles past the anchor each frame's own anchor is (B, F, 2), as history (the anchor of its
    chunk's last frame: a chunk is re-anchored there when it enters the history) and as a target
    (the anchor of the previous chunk's last frame, where the model draws it). The start frame is
    on its own anchor in both."""
    cell = torch.div(cameras.round(), tile, rounding_mode="floor").long()
    q = cameras.round().long() - cell * tile
    f = cameras.shape[1]
    if (f - 1) % chunk:
        raise ValueError(f"{f} frames are not a start frame plus whole chunks of {chunk}")
    i = torch.arange(1, f)
    last = torch.cat([torch.zeros(1, dtype=torch.long), chunk * ((i - 1) // chunk + 1)])
    before = torch.cat([torch.zeros(1, dtype=torch.long), chunk * ((i - 1) // chunk)])
    return q, cell - cell[:, last], cell - cell[:, before]


def on_anchors(ae: FastAutoencoder, wide: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Clips (B, C, F, g, g) of frames `wide` (B, F, C-4, g+2, g+2) with sub-tile offsets q
    (B, F, 2), drawn on the anchors d (B, F, 2) tiles before their own (`chunk_anchors`)."""
    if d.abs().max() > 1:
        raise ValueError("the view moved more than a tile within a chunk")
    b, f = wide.shape[:2]
    z = ae.at_anchor(wide.flatten(0, 1), q.flatten(0, 1), d.flatten(0, 1))
    return z.view(b, f, *z.shape[1:]).permute(0, 2, 1, 3, 4)


def anchored_clips(
    ae: FastAutoencoder, wide: torch.Tensor, cams: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile-aligned clips as the model sees them, from the cells around each frame's own anchor
    (`FastAutoencoder.encode_wide`: wide (B, F, C-4, g+2, g+2)) and the cameras (B, F, 2): as
    targets and as clean history (B, C, F, g, g) each, on the anchors `chunk_anchors` gives."""
    q, d_hist, d_target = chunk_anchors(cams, chunk, ae.cfg.spatial)
    return on_anchors(ae, wide, q, d_target), on_anchors(ae, wide, q, d_hist)


def valid_latent_mask(valid: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, T, H, W) bool frame pixels -> (B, T, H/patch, W/patch) float 0/1: a latent pixel
    counts iff its whole `patch` x `patch` footprint is valid."""
    b, t, h, w = valid.shape
    blocks = valid.view(b, t, h // patch, patch, w // patch, patch)
    return blocks.all(dim=5).all(dim=3).float()

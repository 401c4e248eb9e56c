"""The autoencoder's codebook: the colours of flat tiles, fit on training frames.

A tile-aligned autoencoder snaps every generated cell that draws flat to the nearest entry of its
codebook (`FastAutoencoder.snap_cells`), and the atlas and the terrain prior name tiles by their
entry (`Cartographer.invent`, `TerrainPrior`). The codebook is learned, not copied from the game:
a seeded k-means over the mean colours of the flat cells of training frames. A cell counts when
the autoencoder calls it flat (`FastAutoencoder.flat_cells` on the cells it encodes from the
frame) and the frame's own pixels in it are flat too (a cell under the player's sprite, which
the cells do not draw, is not); its colour is the mean of the frame's pixels there.

The number of entries `k` is a hyper-parameter of the recipe (`TrainConfig.codebook_size`, 8 by
default: the built-in game draws its terrain in 8 shades, which the fit then recovers), not a
constant of the game; `choose_k` picks the smallest that leaves the cells within a tolerance of
their entries, for data whose count of shades is not known.
"""

from __future__ import annotations

import numpy as np
import torch

from models.tiny_world.fast_decoder import SNAP_STD, FastAutoencoder, flat_in_view, place

# `choose_k`: an entry covers the cells within this many RGB levels of it (the snap's flatness
# tolerance, `SNAP_STD`, in 0-255 levels), all but this share of the cells' weight.
COVER_LEVELS = SNAP_STD * 127.5
COVER_SHARE = 0.99


@torch.no_grad()
def flat_colours(
    ae: FastAutoencoder, frames: np.ndarray, offsets: np.ndarray, batch: int = 256
) -> np.ndarray:
    """(M, 3) float64 RGB 0-255: the mean colour of every cell of `frames` (N, H, W, 3) uint8,
    at sub-tile offsets `offsets` (N, 2) (the camera modulo the tile: where the cells lie), that
    the autoencoder calls flat and whose pixels are flat in the frame (module docstring)."""
    cfg = ae.cfg
    if not cfg.frame_size:
        raise ValueError("a codebook needs a tile-aligned autoencoder (FastAEConfig.frame_size)")
    if frames.shape[0] != offsets.shape[0]:
        raise ValueError(f"{frames.shape[0]} frames but {offsets.shape[0]} offsets")
    s, g = cfg.spatial, cfg.canvas_cells
    p = ae.latents_std
    out = []
    for i in range(0, frames.shape[0], batch):
        x = torch.from_numpy(frames[i : i + batch]).to(p.device, p.dtype).div(127.5).sub(1.0)
        pos = torch.from_numpy(offsets[i : i + batch]).to(p.device).long() + 2 * s
        canvas = place(x.permute(0, 3, 1, 2), pos, g * s)  # (n, 4, S, S): pixels, then where the frame is
        pixels, cover = canvas[:, :3], canvas[:, 3:]
        cells = ae.quant(ae.encoder(canvas))
        drawn, _ = ae.flat_cells(cells, cover)
        shown, colour = flat_in_view(pixels, cover, s)
        keep = (drawn & shown)[:, 0]  # (n, g, g)
        out.append(colour.permute(0, 2, 3, 1)[keep].double().cpu().numpy())
    return (np.concatenate(out) + 1.0) * 127.5


def kmeans(
    points: np.ndarray,
    k: int,
    seed: int = 0,
    weights: np.ndarray | None = None,
    iters: int = 100,
    restarts: int = 4,
) -> tuple[np.ndarray, float]:
    """Weighted k-means of `points` (N, D): k-means++ seeding from a generator seeded with
    `seed`, Lloyd iterations to convergence (at most `iters`), the best of `restarts` by
    inertia. Returns the centres (k, D) and their inertia (the weighted mean squared distance of
    the points to their centres). Deterministic for a seed; k must not exceed N."""
    x = np.asarray(points, dtype=np.float64)
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k-means of {n} points into {k} clusters")
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    rng = np.random.default_rng(seed)
    best, best_inertia = x[:k], np.inf
    for _ in range(restarts):
        centres = x[rng.choice(n, p=w)][None]
        for _ in range(1, k):
            d2 = ((x[:, None] - centres[None]) ** 2).sum(-1).min(1)
            p = w * d2
            # Every point already a centre (fewer distinct points than k): take any, weighted.
            centres = np.vstack([centres, x[rng.choice(n, p=p / p.sum() if p.sum() > 0 else w)]])
        for _ in range(iters):
            label = ((x[:, None] - centres[None]) ** 2).sum(-1).argmin(1)
            mass = np.bincount(label, weights=w, minlength=k)
            sums = np.stack([np.bincount(label, weights=w * col, minlength=k) for col in x.T], axis=1)
            # An emptied cluster keeps its centre (it cannot move toward points it has none of).
            new = np.where(mass[:, None] > 0, sums / np.maximum(mass, 1e-300)[:, None], centres)
            if np.allclose(new, centres):
                break
            centres = new
        inertia = float((w * ((x - centres[label]) ** 2).sum(-1)).sum())
        if inertia < best_inertia:
            best, best_inertia = centres, inertia
    return best, best_inertia


def fit_codebook(colours: np.ndarray, k: int, seed: int = 0) -> list[list[int]]:
    """The codebook of `colours` (M, 3) RGB 0-255 (`flat_colours`): the k-means centres of the
    distinct colours weighted by their counts, rounded to RGB levels and sorted (so the order,
    which the terrain prior's classes follow, depends on the colours alone). Fewer distinct
    colours than k: those colours."""
    if colours.ndim != 2 or colours.shape[1] != 3 or not len(colours):
        raise ValueError(f"a codebook is fit on (M, 3) colours, not {colours.shape}")
    levels, counts = np.unique(np.rint(colours).clip(0, 255).astype(np.int64), axis=0, return_counts=True)
    if len(levels) <= k:
        return levels.tolist()
    centres, _ = kmeans(levels.astype(np.float64), k, seed, weights=counts)
    book = np.unique(np.rint(centres).clip(0, 255).astype(np.int64), axis=0)
    return book.tolist()


def covered(colours: np.ndarray, book: list[list[int]]) -> float:
    """The share of `colours` (M, 3) within `COVER_LEVELS` (Euclidean, RGB levels) of their
    nearest entry of `book`."""
    d = np.sqrt(((colours[:, None] - np.asarray(book, dtype=np.float64)[None]) ** 2).sum(-1).min(1))
    return float((d <= COVER_LEVELS).mean())


def choose_k(colours: np.ndarray, k_max: int = 16, seed: int = 0) -> int:
    """The smallest k <= `k_max` whose codebook leaves `COVER_SHARE` of `colours` within
    `COVER_LEVELS` of an entry (`k_max` where none does)."""
    for k in range(1, k_max + 1):
        if covered(colours, fit_codebook(colours, k, seed)) >= COVER_SHARE:
            return k
    return k_max

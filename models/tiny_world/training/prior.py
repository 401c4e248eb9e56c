"""The terrain prior stage (`models.tiny_world.terrain_prior`): its data and its training.

Each example is one tile of a map and what a session knows around it when that tile first comes
into view (`known_mask`): the tiles behind the edge the view moves across, the rows that view
spans, now and then a patch seen earlier, and the new line's tiles of the passes before the
tile's own (`TerrainPrior.fill`); a few known tiles are hidden (a creature or the player on
them). Rotated and mirrored, that covers every direction of motion.
`PriorStage` is the trainer's `terrain` stage."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from models.game import GameConfig, generate_world
from models.tiny_world.terrain_prior import PASS_SPAN, RESIDUE_RANK, TerrainPrior, TerrainPriorConfig


@dataclass(frozen=True)
class TerrainTrainConfig:
    """How the prior is trained (the recipe's `terrain` stage)."""

    steps: int = 3000
    batch: int = 512
    lr: float = 2e-3
    window: int = 7
    width: int = 128
    held_out: int = 32  # the last maps, kept for the held-out figures (a fifth of them at most)


def terrain_config(
    codebook: Sequence[Sequence[int]], cfg: TerrainTrainConfig | None = None
) -> TerrainPriorConfig:
    """The prior of an autoencoder with `codebook` (one class per entry) as `cfg` shapes it."""
    cfg = cfg or TerrainTrainConfig()
    return TerrainPriorConfig(classes=len(codebook), window=cfg.window, width=cfg.width)


def class_maps(seeds: Sequence[int], codebook: Sequence[Sequence[int]], config: GameConfig) -> np.ndarray:
    """(E, T, T) int64: each world's tiles as indices into `codebook`, each tile its colour's
    nearest entry (the codebook is fit on frames: `models.tiny_world.training.codebook`)."""
    book = np.asarray(codebook, dtype=np.int64)  # (K, 3)
    if book.ndim != 2 or book.shape[1] != 3 or not len(book):
        raise ValueError(f"class maps need a codebook of RGB colours, not {book.tolist()}")
    maps = []
    for seed in seeds:
        rgb = generate_world(seed, config).rgb.astype(np.int64)  # (T, T, 3)
        maps.append(((rgb[:, :, None, :] - book) ** 2).sum(-1).argmin(-1))
    return np.stack(maps)


def known_mask(rng: np.random.Generator, window: int) -> np.ndarray:
    """(window, window) bool: what a session knows around a tile (the centre) that is coming into
    view for the first time, the view moving toward +x (rotate for the other directions)."""
    r = window // 2
    dy, dx = np.mgrid[-r : r + 1, -r : r + 1]
    top = rng.integers(-9, 2)  # the rows the latest view spans: [top, top + 8] (the centre's or next to it)
    rows = (dy >= top) & (dy <= top + 8)
    known = (dx < 0) & rows
    # The new column is drawn in passes along it (`pass_order`): the tile knows the ones drawn in
    # the passes before its own.
    residue = int(rng.integers(PASS_SPAN))
    rank = np.asarray(RESIDUE_RANK)
    known |= (dx == 0) & rows & (rank[(residue + dy) % PASS_SPAN] < rank[residue])
    if rng.random() < 0.3:  # a patch shown earlier, ahead of the view
        y0, x0 = rng.integers(-r, r + 1, size=2)
        h, w = rng.integers(1, window, size=2)
        known |= (dy >= y0) & (dy < y0 + h) & (dx >= x0) & (dx < x0 + w)
    known &= rng.random((window, window)) >= 0.05  # a creature or the player hides a tile now and then
    known[r, r] = False
    return known


def examples(
    maps: np.ndarray, rng: np.random.Generator, n: int, window: int, unknown: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` random (window classes (n, window, window), centre class (n,)) pairs from `maps`: a tile
    of a random map, its neighbourhood as `known_mask` leaves it (outside the world: unknown)."""
    e, t, _ = maps.shape
    r = window // 2
    padded = np.pad(maps, ((0, 0), (r, r), (r, r)), constant_values=unknown)
    idx = rng.integers(0, e, size=n)
    ys, xs = rng.integers(0, t, size=n), rng.integers(0, t, size=n)
    out = np.empty((n, window, window), dtype=np.int64)
    for i in range(n):
        win = padded[idx[i], ys[i] : ys[i] + window, xs[i] : xs[i] + window]
        mask = np.rot90(known_mask(rng, window), k=int(rng.integers(4)))
        if rng.random() < 0.5:
            mask = mask[:, ::-1]
        out[i] = np.where(mask, win, unknown)
    return torch.from_numpy(out), torch.from_numpy(maps[idx, ys, xs])


def evaluate(prior: TerrainPrior, maps: np.ndarray, seed: int, n: int = 8192) -> dict:
    """Held-out figures: the prior's cross-entropy (nats) and accuracy on `n` examples of `maps`,
    against the classes' frequencies alone."""
    rng = np.random.default_rng(seed)
    windows, target = examples(maps, rng, n, prior.cfg.window, prior.cfg.unknown)
    with torch.no_grad():
        logits = prior(windows)
    freq = torch.bincount(torch.from_numpy(maps).flatten(), minlength=prior.cfg.classes).double()
    base = -(freq / freq.sum()).log()[target].mean()
    return {
        "cross_entropy": float(F.cross_entropy(logits, target)),
        "accuracy": float((logits.argmax(-1) == target).double().mean()),
        "frequency_cross_entropy": float(base),
        "examples": n,
    }


def train_terrain(
    maps: np.ndarray,
    codebook: Sequence[Sequence[int]],
    cfg: TerrainTrainConfig,
    seed: int = 0,
    log_every: int = 500,
) -> tuple[TerrainPrior, dict]:
    """Train a prior on `maps` (E, T, T) of indices into `codebook` (its last `cfg.held_out` maps
    held out); returns it and its held-out figures (`evaluate`). Deterministic given `seed`."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cut = len(maps) - min(cfg.held_out, max(1, len(maps) // 5))  # a fifth at most (tiny runs)
    train, held = maps[:cut], maps[cut:]
    prior = TerrainPrior(terrain_config(codebook, cfg))
    unknown = prior.cfg.unknown
    opt = torch.optim.AdamW(prior.parameters(), lr=cfg.lr, weight_decay=0.01)
    for step in range(cfg.steps):
        lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        windows, target = examples(train, rng, cfg.batch, cfg.window, unknown)
        loss = F.cross_entropy(prior(windows), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log_every and (step % log_every == 0 or step == cfg.steps - 1):
            print(f"terrain step {step} loss {loss.item():.4f} lr {lr:.2e}", flush=True)
    prior.eval()
    return prior, evaluate(prior, held, seed + 1)


class PriorStage:
    """The trainer's `terrain` stage (a part of `Trainer`)."""

    def train_terrain(self) -> None:
        """The `terrain` stage: the terrain prior (`models.tiny_world.terrain_prior`) on the training worlds'
        maps in the autoencoder's codebook classes (`class_maps`). Records its held-out figures in the log."""
        c = self.cfg
        t0 = time.monotonic()
        maps = class_maps(
            range(c.world_seed_base, c.world_seed_base + c.episodes), self.ae.cfg.codebook, GameConfig()
        )
        self.terrain, record = train_terrain(
            maps, self.ae.cfg.codebook, TerrainTrainConfig(steps=c.terrain_steps), seed=c.seed
        )
        self.log({**record, "seconds": round(time.monotonic() - t0, 1), "t": self.total_elapsed()})
        self.stage, self.step = "creatures", 0
        self.checkpoint()

"""The creature stage (`models.tiny_world.creature_head`): its data (the episodes' own creature
tracks), the walk's training, the births' fit and their held-out figures; `CreatureStage` is the
trainer's `creatures` stage.

The game is the data source, not a rule the head inherits: the walk's labels are where the
recorded creatures went in the frames after each chunk start, and the births' table counts how
often a creature's square started in the training frames' tiles of each class.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.game import GameConfig, random_policy, simulate
from models.tiny_world import SIZE
from models.tiny_world.atlas import Cartographer
from models.tiny_world.creature_head import CreatureHead, CreatureHeadConfig
from models.tiny_world.data import sim_cameras
from models.tiny_world.fast_decoder import FastAutoencoder, corner_cells, creature_channels


@dataclass(frozen=True)
class CreatureTraining:
    """How a creature head is trained (the recipe's `creatures` stage)."""

    steps: int = 4000  # AdamW steps of the walk
    batch: int = 128  # chunk starts per step
    lr: float = 2e-3  # peak learning rate (cosine to 0)
    episodes: int = 256  # training episodes read (the first of the run's)
    held_out: int = 32  # of them, the last kept out for the held-out figures
    still: float = 0.25  # share of examples whose earlier layers repeat the latest (a creature seen once)
    seed: int = 0


def creature_config(ae: FastAutoencoder, horizon: int = 4) -> CreatureHeadConfig:
    """The creature head of a tile-aligned, creature-layered autoencoder with a codebook."""
    cfg = ae.cfg
    if not (cfg.frame_size and cfg.creatures and cfg.codebook):
        raise ValueError("a creature head needs tile-aligned latents with a creature layer and a codebook")
    return CreatureHeadConfig(
        cell_channels=cfg.cell_channels,
        classes=len(cfg.codebook),
        spatial=cfg.spatial,
        horizon=horizon,
        canvas=cfg.canvas_cells,
    )


def creature_tracks(seeds: Sequence[int], n_actions: int) -> tuple[np.ndarray, np.ndarray]:
    """The training episodes' cameras (E, N+1, 2) and creatures' drawn top-left pixels in the
    world (E, N+1, K, 2), both rounded to whole frame pixels (`random_policy`, as `make_episodes`
    plays them)."""
    config = GameConfig(size=SIZE)
    cams, tracks = [], []
    for seed in seeds:
        sim = simulate(int(seed), random_policy(int(seed), n_actions), config, layers=True)
        cam = np.rint(sim_cameras(sim, config)).astype(np.int64)
        cams.append(cam)
        tracks.append(sim.creature_corners + cam[:, None])
    return np.stack(cams), np.stack(tracks)


@dataclass
class CreatureData:
    """What the walk and the births learn from, every frame on its own anchor's canvas."""

    cells: torch.Tensor  # (E, N+1, k, g, g) float16 normalised terrain cells
    origin: np.ndarray  # (E, N+1, 2) long: the canvas' top-left pixel in the world
    offsets: np.ndarray  # (E, N+1, 2) long: the view's offset from its anchor (the camera mod s)
    tracks: np.ndarray  # (E, N+1, K, 2) long: creatures' drawn top-left pixels in the world
    spatial: int

    @classmethod
    def from_latents(
        cls, wide: torch.Tensor, cameras: np.ndarray, tracks: np.ndarray, cell_channels: int, spatial: int
    ) -> CreatureData:
        """From the trainer's cached latents (`encode_wide`: (E, N+1, C-4, g+2, g+2)) and the
        episodes' `creature_tracks`."""
        s = spatial
        cells = wide[:, :, :cell_channels, 1:-1, 1:-1]  # the frame's own anchor (`at_anchor`, d = 0)
        offsets = cameras % s
        return cls(cells, cameras - (offsets + 2 * s), offsets, tracks, s)

    def layer(self, e: np.ndarray, t: np.ndarray, at: np.ndarray) -> torch.Tensor:
        """Raw creature channels (B, 3, g, g) of episodes `e` at frames `at`, on frames `t`'s canvases."""
        g = self.cells.shape[-1]
        corners = torch.from_numpy(self.tracks[e, at] - self.origin[e, t][:, None])
        present, offsets = corner_cells(corners, torch.zeros(len(e), 2, dtype=torch.long), g, self.spatial)
        return creature_channels(present, offsets, self.spatial)

    def batch(
        self, e: np.ndarray, t: np.ndarray, cfg: CreatureHeadConfig, still: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chunk starts (episode e, frame t) -> terrain cells (B, k, g, g), creature layers
        (B, lags, 3, g, g) of frames t - lags + 1 .. t (`still`: the latest in every place), and
        for each creature on frame t's canvas (M of them): its example row (M,) and its target
        (M, 2 + 2 horizon): its cell (x, y), then its cumulative move class into each of the next
        `horizon` frames, x then y."""
        s, g, m = self.spatial, self.cells.shape[-1], cfg.max_step
        latest = self.layer(e, t, t)
        layers = []
        for lag in range(cfg.lags - 1, 0, -1):
            earlier = self.layer(e, t, t - lag)
            if still is not None:
                earlier = torch.where(torch.from_numpy(still)[:, None, None, None], latest, earlier)
            layers.append(earlier)
        layers = torch.stack([*layers, latest], dim=1)
        start = self.tracks[e, t] - self.origin[e, t][:, None]  # (B, K, 2) canvas px
        rows, k = np.nonzero(((start >= 0) & (start < g * s)).all(-1))
        ahead = t[rows, None] + np.arange(1, cfg.horizon + 1)
        moves = self.tracks[e[rows, None], ahead, k[:, None]] - self.tracks[e[rows], t[rows], k][:, None]
        labels = torch.from_numpy(np.clip(moves, -m, m) + m)
        cell = torch.from_numpy(start[rows, k] // s)
        target = torch.cat([cell, labels.flatten(1)], 1)
        return self.cells[e, t].float(), layers, torch.from_numpy(rows), target


def walk_logits(head: CreatureHead, cells: torch.Tensor, layers: torch.Tensor, rows, cell) -> torch.Tensor:
    """(M, horizon, 2, moves): the head's move logits at each creature's cell."""
    return head(cells, layers)[rows, :, :, :, cell[:, 1], cell[:, 0]]


def fit_births(head: CreatureHead, data: CreatureData, codes: torch.Tensor, episodes: np.ndarray) -> dict:
    """Set `head.births` to the training frames' rates (maximum likelihood, half a count of
    smoothing): per tile class (the nearest of the codebook's `codes` (K, k) to a cell wholly in
    view), how often a creature's square starts in it and at which pixel. Returns the counts."""
    s, g, k_cls = data.spatial, data.cells.shape[-1], codes.shape[0]
    tiles = torch.zeros(k_cls, dtype=torch.float64)
    met = torch.zeros(k_cls, s * s, dtype=torch.float64)
    edge = np.arange(g) * s
    for e in episodes:
        frames = data.cells.shape[1]
        # The view's top-left corner on each frame's canvas: two cells in, plus the camera's offset.
        corner = data.offsets[e] + 2 * s  # (N+1, 2)
        inside = (edge >= corner[:, :, None]) & (edge + s <= corner[:, :, None] + SIZE)  # (N+1, 2, g)
        whole = torch.from_numpy(inside[:, 1, :, None] & inside[:, 0, None, :])  # (N+1, g, g)
        cells = data.cells[e].float()  # (N+1, k, g, g)
        cls = (cells.movedim(1, -1)[..., None, :] - codes).square().sum(-1).argmin(-1)  # (N+1, g, g)
        corners = torch.from_numpy(data.tracks[e] - data.origin[e][:, None])
        present, offsets = corner_cells(corners, torch.zeros(frames, 2, dtype=torch.long), g, s)
        tiles += torch.bincount(cls[whole], minlength=k_cls).double()
        hit = whole & present
        where = (offsets[:, 1] * s + offsets[:, 0])[hit]
        met.index_put_((cls[hit], where), torch.ones(len(where), dtype=torch.float64), accumulate=True)
    n_met = met.sum(-1)
    rate = (n_met + 0.5) / (tiles + 1.0)
    with torch.no_grad():
        head.births[:, 0] = torch.logit(rate).float()
        head.births[:, 1:] = torch.log((met + 0.5) / (n_met[:, None] + 0.5 * s * s)).float()
    return {"tiles_by_class": tiles.long().tolist(), "creatures_by_class": n_met.long().tolist()}


def fit_entries(head: CreatureHead, data: CreatureData, episodes: np.ndarray) -> dict:
    """Set `head.entries` to the training episodes' rates (maximum likelihood, a hundredth of a
    count of smoothing): per canvas pixel, the share of chunks (every start frame t, its canvas)
    at whose end (t + horizon) a creature that was off the canvas at t starts there."""
    s, g, h = data.spatial, data.cells.shape[-1], head.cfg.horizon
    size = g * s
    counts = torch.zeros(size, size, dtype=torch.float64)
    chunks = 0
    for e in episodes:
        t = np.arange(data.cells.shape[1] - h)
        before = data.tracks[e, t] - data.origin[e, t][:, None]  # (T, K, 2) canvas px at the start
        after = data.tracks[e, t + h] - data.origin[e, t][:, None]
        came = ~((before >= 0) & (before < size)).all(-1) & ((after >= 0) & (after < size)).all(-1)
        px = torch.from_numpy(after[came])
        counts.index_put_((px[:, 1], px[:, 0]), torch.ones(len(px), dtype=torch.float64), accumulate=True)
        chunks += len(t)
    rate = (counts + 0.01) / (chunks + 0.02)
    with torch.no_grad():
        head.entries.copy_(torch.logit(rate).float())
    return {"entries_per_chunk": float(counts.sum() / max(1, chunks))}


def train_walk(
    head: CreatureHead, data: CreatureData, train: np.ndarray, tr: CreatureTraining, progress: bool = True
) -> float:
    """Train the walk on chunk starts of the `train` episodes; returns the last loss."""
    cfg = head.cfg
    rng = np.random.default_rng(tr.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=tr.lr, weight_decay=0.01)
    first, last = cfg.lags - 1, data.cells.shape[1] - cfg.horizon  # t in [first, last)
    bar = tqdm(range(tr.steps), desc="creature walk", disable=not progress, file=sys.stderr)
    loss_val = float("nan")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = tr.lr * 0.5 * (1 + math.cos(math.pi * step / tr.steps))
        e, t = rng.choice(train, tr.batch), rng.integers(first, last, tr.batch)
        cells, layers, rows, target = data.batch(e, t, cfg, rng.random(tr.batch) < tr.still)
        if not len(rows):
            continue
        logits = walk_logits(head, cells, layers, rows, target[:, :2])
        loss = F.cross_entropy(logits.reshape(-1, cfg.moves), target[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_val = loss.item()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss_val:.4f}")
    return loss_val


@torch.no_grad()
def walk_accuracy(head: CreatureHead, data: CreatureData, episodes: np.ndarray) -> dict:
    """From every frame of `episodes` with history: the share of creatures' per-frame, per-axis
    cumulative moves the head predicts exactly (its rounded expectation, as served), of whole
    chunks, and both for standing still (what a head that learned nothing predicts), with the
    history seen and with the creature seen once (`still`)."""
    cfg = head.cfg
    t_all = np.arange(cfg.lags - 1, data.cells.shape[1] - cfg.horizon)
    out: dict[str, float] = {}
    for name, still in (("", False), ("_seen_once", True)):
        hits = chunks = static = count = 0
        for e0 in episodes:
            e = np.full(len(t_all), e0)
            cells, layers, rows, target = data.batch(e, t_all, cfg, np.full(len(t_all), still))
            if not len(rows):
                continue
            pred = head.expected(walk_logits(head, cells, layers, rows, target[:, :2]), dim=-1).long()
            truth = target[:, 2:].view(-1, cfg.horizon, 2) - cfg.max_step
            hits += int((pred == truth).sum())
            chunks += int((pred == truth).all(-1).all(-1).sum())
            static += int((truth == 0).sum())
            count += len(rows)
        axes = max(1, count * cfg.horizon * 2)
        out |= {
            f"frame_axes_exact{name}": hits / axes,
            f"chunks_exact{name}": chunks / max(1, count),
            f"frame_axes_standing_still{name}": static / axes,
        }
    out["creatures"] = count
    return out


def train_creatures(
    ae: FastAutoencoder,
    wide: torch.Tensor,
    cameras: np.ndarray,
    tracks: np.ndarray,
    tr: CreatureTraining,
    progress: bool = True,
) -> tuple[CreatureHead, dict]:
    """A creature head for `ae` from the trainer's cached latents `wide` and the episodes'
    `creature_tracks` (the first `tr.episodes`; their last `tr.held_out` kept for the figures)."""
    torch.manual_seed(tr.seed)
    cfg = creature_config(ae)
    n = min(tr.episodes, len(wide))
    held = min(tr.held_out, max(1, n // 5))
    if n - held < 1:
        raise ValueError(f"{n} episode(s): none left to train the creature head on beside the held-out")
    data = CreatureData.from_latents(wide[:n], cameras[:n], tracks[:n], cfg.cell_channels, cfg.spatial)
    head = CreatureHead(cfg)
    codes = Cartographer(ae, ae.cfg.canvas_cells).codes(tuple(tuple(c) for c in ae.cfg.codebook)).float()
    counts = fit_births(head, data, codes, np.arange(n - held)) | fit_entries(head, data, np.arange(n - held))
    loss = train_walk(head, data, np.arange(n - held), tr, progress)
    head.eval()
    figures = walk_accuracy(head, data, np.arange(n - held, n))
    return head, {"final_loss": loss, **figures, **counts}


class CreatureStage:
    """The trainer's `creatures` stage (a part of `Trainer`)."""

    def train_creatures(self) -> None:
        """The `creatures` stage: a creature head (`models.tiny_world.creature_head`) on the
        training episodes' latents and creature tracks; records its held-out figures in the log.
        Skipped (no head) without a creature layer or a terrain prior to meet creatures in."""
        c = self.cfg
        self.stage = "creatures"  # also when entered from `init_from` (models/tiny_world/creatures.py)
        t0 = time.monotonic()
        if c.creature_steps > 0 and self.ae.cfg.creatures and self.terrain is not None:
            tr = CreatureTraining(steps=c.creature_steps, seed=c.seed)
            n = min(tr.episodes, c.episodes)
            wide, _, _, _ = self.latents()
            seeds = range(c.world_seed_base, c.world_seed_base + n)
            cameras, tracks = creature_tracks(seeds, c.episode_frames)
            self.creatures, record = train_creatures(self.ae, wide, cameras, tracks, tr, self.progress)
            self.log({**record, "seconds": round(time.monotonic() - t0, 1), "t": self.total_elapsed()})
        self.stage, self.step = "done", 0
        self.checkpoint()

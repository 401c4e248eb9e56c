"""Does the tiny world keep moving under a held key? Its own history against the game's.

    python benchmarks/tiny_world_history_probe.py [--model tiny-world DIR ...] [--worlds 8] [--chunks 8]

In held-out worlds where the game scrolls freely under "d" for the whole probe, hold "d" and read,
chunk after chunk, how far the view moves (px per 4-frame chunk; the game: 4):

* `own`: the served rollout through the Engine, each chunk on the model's own earlier chunks;
* `game_history`: each chunk sampled by the same sampler from the game's own frames as history
  (encoded, in the serving window and mask): teacher forcing at serving time;
* `stall_chunk`: chunk 4 (whose 16-frame window no longer holds the start frame) sampled on the
  model's own history, on it with its latest or its oldest visible frame taken from the game, and
  on the game's (px over the chunk's 4 frames, read frame to frame).

A model that moves with the game's history but stops on its own has learned to read the history's
look (sharp frames), not the key: exposure bias. Writes --out/tiny_world_history_probe.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tiny_world_eval import EVAL_SEED_BASE, batched
from models.game import GameConfig, SimResult, simulate
from models.registry import from_name
from models.tiny_world.data import action_rows, sim_cameras
from models.tiny_world.fast_decoder import FastAutoencoder
from models.tiny_world.metrics import free_worlds, scroll_offset
from models.tiny_world.training.history import rollout_history
from models.tiny_world.training.targets import anchored_clips
from models.world import World
from runtime.engine import Engine


def per_chunk(frames: np.ndarray, chunk: int) -> list[float]:
    """Scroll (x, px) between the last frames of consecutive chunks (frame 0 starts)."""
    ends = range(0, len(frames), chunk)
    return [
        float(scroll_offset(frames[a], frames[b], radius=chunk + 2, ignore=(32.0, 32.0))[0])
        for a, b in itertools.pairwise(ends)
    ]


def game_latents(ae: FastAutoencoder, video: torch.Tensor, sim: SimResult, chunk: int) -> torch.Tensor:
    """The game's clip (1, 3, F, H, W) encoded as a session's history: (1, C, F, h, w) (tile-aligned
    latents: each chunk on the anchor of its last frame, `anchored_clips`)."""
    if not ae.cfg.frame_size:
        return ae.encode_float(video)
    cams = torch.from_numpy(sim_cameras(sim, GameConfig()))[None]  # (1, F, 2)
    wide = ae.encode_wide(video[0].transpose(0, 1), cams[0].round().long() % ae.cfg.spatial)
    return anchored_clips(ae, wide[None], cams, chunk)[1]


def to_frames(world: World, latents: torch.Tensor) -> np.ndarray:
    """Latents (1, C, F, h, w) decoded by the world's autoencoder: (F, H, W, 3) uint8."""
    frames = world.decoder.ae.decode_float(latents)[0].clamp(-1, 1)
    return ((frames.permute(1, 2, 3, 0) + 1) * 127.5).round().byte().numpy()


@torch.no_grad()
def game_history_chunk(
    world: World, latents: torch.Tensor, actions: torch.Tensor, k: int, gen: torch.Generator
) -> np.ndarray:
    """Chunk k (1-based) sampled by the serving sampler and window on the game's encoded frames
    0 .. 4(k-1) as history (`rollout_history` from chunk k). Returns its last frame (H, W, 3)."""
    end = 1 + world.chunk_frames * k
    lat = rollout_history(
        world.transformer,
        latents[:, :, :end],
        actions[:, :end],
        world.config.schedule,
        gen,
        first=k - 1,
        canonical=world.decoder.canonical,
        carry_channels=world.plugin.settings.carry_channels,
    )
    return to_frames(world, lat[:, :, end - 1 : end])[0]


@torch.no_grad()
def stall_chunk(world: World, latents: torch.Tensor, actions: torch.Tensor, gen: torch.Generator) -> dict:
    """Which history frame lets the model keep moving? Chunk k = window / chunk, whose window
    holds frames 4k - W + 1 .. 4k only (no start frame), sampled on four histories: the model's
    own rollout, the same with its latest or its oldest visible frame taken from the game, and
    the game's. Returns the px it moves over those 4 frames per history (the game: 4)."""
    dit, sched, chunk = world.transformer, world.config.schedule, world.chunk_frames
    k = dit.cfg.window_frames // chunk
    end = 1 + chunk * k
    snap, carried = world.decoder.canonical, world.plugin.settings.carry_channels
    own = rollout_history(
        dit, latents[:, :, :end], actions[:, :end], sched, gen, canonical=snap, carry_channels=carried
    )
    latest, oldest = own.clone(), own.clone()
    latest[:, :, end - 1] = latents[:, :, end - 1]
    first_seen = end - (dit.cfg.window_frames - chunk)
    oldest[:, :, first_seen] = latents[:, :, first_seen]
    histories = {
        "own": own,
        "own_latest_from_game": latest,
        "own_oldest_from_game": oldest,
        "game": latents[:, :, :end],
    }
    out = {}
    for name, hist in histories.items():
        clip = torch.cat([hist, latents[:, :, end : end + chunk]], dim=2)  # chunk k is resampled
        lat = rollout_history(
            dit, clip, actions[:, : end + chunk], sched, gen, first=k, canonical=snap, carry_channels=carried
        )
        frames = to_frames(world, lat[:, :, end - 1 :])
        steps = [scroll_offset(a, b, radius=2, ignore=(32.0, 32.0))[0] for a, b in itertools.pairwise(frames)]
        out[name] = float(sum(steps))
    return out


def probe(name: str, worlds: list[int], chunks: int) -> dict:
    world = from_name(name)
    chunk = world.chunk_frames
    n = chunks * chunk
    engine = Engine({"m": world}, max_batch=8, max_streams=16)
    own, _ = batched(engine, "m", worlds, [[frozenset({"d"})] * n for _ in worlds], 8)
    own_moves = np.array([per_chunk(f, chunk) for f in own])  # (W, chunks)
    gen = torch.Generator().manual_seed(0)
    ae = world.decoder.ae.eval()
    game_moves, stalls = [], []
    for seed in worlds:
        sim = simulate(seed, [frozenset({"d"})] * n)
        video = torch.from_numpy(sim.frames).float().permute(3, 0, 1, 2)[None] / 127.5 - 1.0
        latents = game_latents(ae, video, sim, chunk)
        acts = torch.from_numpy(action_rows([frozenset({"d"})] * n))[None, :, None]
        row = []
        for k in range(1, chunks + 1):
            last = game_history_chunk(world, latents, acts, k, gen)
            prev = sim.frames[chunk * (k - 1)]
            row.append(float(scroll_offset(prev, last, radius=chunk + 2, ignore=(32.0, 32.0))[0]))
        game_moves.append(row)
        stalls.append(stall_chunk(world, latents, acts, gen))
    game_moves = np.array(game_moves)
    return {
        "model": name,
        "own_px_per_chunk_median": np.median(own_moves, 0).tolist(),
        "own_px_per_chunk_mean": own_moves.mean(0).round(2).tolist(),
        "game_history_px_per_chunk_median": np.median(game_moves, 0).tolist(),
        "game_history_px_per_chunk_mean": game_moves.mean(0).round(2).tolist(),
        "own_total_px": float(np.median(own_moves.sum(1))),
        "stall_chunk_px_median": {h: float(np.median([r[h] for r in stalls])) for h in stalls[0]},
        "game_total_px": chunks * chunk,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", nargs="+", default=["tiny-world"], help="registry names or model directories"
    )
    parser.add_argument("--worlds", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.chunks < 5:
        parser.error("--chunks must be at least 5: the stall probe samples chunk 4 and reads the game's next")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    t0 = time.perf_counter()
    worlds = free_worlds(args.worlds, args.chunks * 4, EVAL_SEED_BASE + 9000, keys="d")
    rows = []
    for name in args.model:
        rows.append(probe(name, worlds, args.chunks))
        print(json.dumps(rows[-1]))
    write_result("tiny_world_history_probe", args.out, rows, t0, worlds=worlds)
    return 0


def write_result(benchmark: str, out: Path, rows: list[dict], t0: float, **fields: object) -> Path:
    """Write OUT/<benchmark>.json: the command line, `fields`, the rows and the seconds since `t0`."""
    result = {
        "benchmark": benchmark,
        "command": f"python benchmarks/{benchmark}.py " + " ".join(sys.argv[1:]),
        **fields,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{benchmark}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    raise SystemExit(main())

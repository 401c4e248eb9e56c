"""Does the tiny world see walls, with no motion in its history to go by?

    python benchmarks/tiny_world_wall_probe.py [--model tiny-world DIR ...] [--cases 12] [--frames 12]

The eval's wall probe (`tiny_world_eval.py`) walks into a wall from the spawn, so a model that
continues its history's motion walks on. Here every rollout starts from a single game frame (the
DiT, the serving sampler and the world's key gate, if it has one, directly; the frame encoded on
its own camera phase, as the trainer cuts a clip's start) and holds one key for `--frames`
frames, in the eval's wall worlds:

* `into_wall`: pressed against the wall (frame 20 of the eval's walk), the same key: the game
  stays (0 px);
* `away`: from there, the opposite key: the game walks off (free);
* `spawn`: from the spawn toward the wall: the game walks up to it and stops;
* `near`: from 4 px before the wall toward it: the game moves 4 px and stops.

A model that sees walls moves less into a wall than away from it; one that does not moves alike
(px the player moves in the world, read from the decoded frames as the eval reads it: the view's
scroll plus the sprite's motion on screen; the median of 2 noise seeds per case; the game's by its
own rule, `held_moves`). Writes --out/tiny_world_wall_probe.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tiny_world_eval import find_wall_cases
from benchmarks.tiny_world_history_probe import write_result
from models.game import GameConfig, SimResult, generate_world, held_moves, simulate
from models.registry import from_name
from models.tiny_world.data import action_rows, sim_cameras
from models.tiny_world.metrics import KEY_AXES, world_displacement
from models.tiny_world.training.history import rollout_history
from models.world import World

AXES = {key: (axis, sign) for key, axis, sign in KEY_AXES}
OPPOSITE = {"a": "d", "d": "a", "w": "s", "s": "w"}
HOLD = 24  # the eval's wall walk
PRESSED = 20  # the walk's frame used as "pressed against the wall" (every case is blocked by 16)


def start_latent(world: World, sim: SimResult, t: int, config: GameConfig) -> torch.Tensor:
    """Frame t of a simulation as normalised latents (C, 1, h, w) on its own camera phase."""
    frame = torch.from_numpy(sim.frames[t]).float().div(127.5).sub(1.0).permute(2, 0, 1)[None, :, None]
    phase = torch.from_numpy(sim_cameras(sim, config)[t : t + 1][None]).round().long() % config.tile
    return world.decoder.ae.encode_float(frame, phase)[0]


def model_move(world: World, start: torch.Tensor, key: str, frames: int, seed: int) -> float:
    """px the model's player moves in the world in `key`'s direction over `frames` frames from
    `start` (read from the decoded frames, `world_displacement`)."""
    x0 = torch.zeros(1, start.shape[0], 1 + frames, *start.shape[2:])
    x0[0, :, :1] = start
    acts = torch.from_numpy(action_rows([frozenset({key})] * frames))[None, :, None]
    with torch.no_grad():
        lat = rollout_history(
            world.transformer,
            x0,
            acts,
            world.config.schedule,
            torch.Generator().manual_seed(seed),
            canonical=world.decoder.canonical,
            carry_channels=world.plugin.settings.carry_channels,
            motion=world.plugin.motion,
        )
    video, _ = world.decoder.decode(lat[0], world.decoder.init_cache())
    axis, sign = AXES[key]
    return float(world_displacement(video.numpy(), axis)[-1] * sign)


def probe(name: str, cases: list[tuple[int, str, int]], frames: int) -> dict:
    world = from_name(name)
    config = GameConfig()
    rows = []
    for seed, key, stop in cases:
        walk = [frozenset({key})] * HOLD
        sim = simulate(seed, walk, config)
        game_world = generate_world(seed, config)
        starts = {
            "into_wall": (PRESSED, key),
            "away": (PRESSED, OPPOSITE[key]),
            "spawn": (0, key),
            "near": (max(stop - 4, 0), key),
        }
        for case, (t, k) in starts.items():
            start = start_latent(world, sim, t, config)
            model = float(np.median([model_move(world, start, k, frames, s) for s in range(2)]))
            game, _ = held_moves(game_world, sim.player_world_pos[t : t + 1], *AXES[k], frames, config)
            rows.append(
                {
                    "seed": seed,
                    "case": case,
                    "key": k,
                    "game": float(game[0] * config.scale),
                    "model": model,
                }
            )
    summary = {}
    for case in ("into_wall", "away", "spawn", "near"):
        rs = [r for r in rows if r["case"] == case]
        summary[case] = {
            "game_px": float(np.mean([r["game"] for r in rs])),
            "model_px": float(np.mean([r["model"] for r in rs])),
            "within_2px": float(np.mean([abs(r["model"] - r["game"]) <= 2 for r in rs])),
        }
    return {"model": name, "summary": summary, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", nargs="+", default=["tiny-world"], help="registry names or model directories"
    )
    parser.add_argument("--cases", type=int, default=12, help="wall worlds (the eval's wall probe's)")
    parser.add_argument("--frames", type=int, default=12, help="frames held per rollout")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    t0 = time.perf_counter()
    cases = find_wall_cases(args.cases, HOLD, GameConfig())
    rows = []
    for name in args.model:
        rows.append(probe(name, cases, args.frames))
        print(json.dumps({"model": name, **rows[-1]["summary"]}))
    write_result("tiny_world_wall_probe", args.out, rows, t0, frames=args.frames)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

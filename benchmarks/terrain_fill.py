"""How fragmented is the terrain the prior draws as the view scrolls, against the game's maps?

    python benchmarks/terrain_fill.py [--model tiny-world|DIR] [--worlds 24] [--columns 40]

Each held-out world's map (seeds from 1_000_000, in the codebook's classes) is scrolled over,
turned to each of the four directions: a 12 x 12 canvas starts on the game's tiles, then moves one
tile at a time, and every new line of tiles is drawn by the terrain prior from what came before
(`TerrainPrior.fill`, the call a session's atlas makes), as served, and, beside it, one tile at a
time down the line (exact sequential sampling from the same prior, slower by the line's length).
Reported: the share of neighbouring tile pairs of different kinds (grass, sand, water, wall) along
the new lines and across them, in the drawn strip and in the game's map under it, and the kinds'
shares. JSON in --out/terrain_fill.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tiny_world_eval import EVAL_SEED_BASE
from models.game import GameConfig
from models.registry import from_name
from models.tiny_world.metrics import terrain_kind
from models.tiny_world.terrain_prior import TerrainPrior
from models.tiny_world.training.prior import class_maps


def scroll(
    prior: TerrainPrior, game: np.ndarray, g: int, columns: int, salt: int, serial: bool
) -> np.ndarray:
    """Start a g x g canvas on the left of `game`'s middle rows, move it right `columns` tiles,
    drawing each new column from `prior` (all of it in one `fill`, or tile by tile if `serial`);
    returns the drawn (g, columns) classes."""
    r, unknown = prior.cfg.window // 2, prior.cfg.unknown
    top = (game.shape[0] - g) // 2
    known = np.full((g + 2 * r, g + columns + 2 * r), unknown, dtype=np.int64)
    known[r : r + g, r : r + g] = game[top : top + g, :g]
    ys, xs = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
    for step in range(1, columns + 1):
        region = torch.from_numpy(known[:, step : step + g + 2 * r].copy())
        places = torch.stack([xs + step, ys])
        lines = [torch.arange(g)] if not serial else [torch.tensor([y]) for y in range(g)]
        for rows in lines:
            fresh = torch.zeros(g, g, dtype=torch.bool)
            fresh[rows, -1] = True
            drawn = prior.fill(region, fresh, places, salt)
            region[r : r + g, r : r + g] = drawn
        known[:, step + g - 1 + r] = region[:, r + g - 1].numpy()
    return known[r : r + g, r + g : r + g + columns]


def boundaries(classes: np.ndarray, kinds: np.ndarray) -> tuple[float, float]:
    """(share of pairs of different kinds along each column, along each row) of a class map."""
    k = kinds[classes]
    return float((k[1:] != k[:-1]).mean()), float((k[:, 1:] != k[:, :-1]).mean())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-world", help="registry name or model directory")
    parser.add_argument("--worlds", type=int, default=24)
    parser.add_argument("--columns", type=int, default=40, help="tiles each walk scrolls")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    world = from_name(args.model)
    prior = world.plugin.terrain
    if prior is None:
        print(f"{args.model} has no terrain prior", file=sys.stderr)
        return 2
    prior = prior.float().eval()
    book, canvas = world.decoder.ae.cfg.codebook, world.decoder.ae.cfg.canvas_cells
    kinds, _ = terrain_kind(np.asarray(book))  # each codebook class's kind, by the game's shades
    maps = class_maps(range(EVAL_SEED_BASE, EVAL_SEED_BASE + args.worlds), book, GameConfig())
    columns = min(args.columns, maps.shape[-1] - canvas)
    t0 = time.perf_counter()
    figures: dict[str, list] = {"game": [], "served": [], "one_tile_at_a_time": []}
    shares: dict[str, list] = {k: [] for k in figures}
    for i, m in enumerate(maps):
        for turn in range(4):
            game = np.rot90(m, turn)
            top = (game.shape[0] - canvas) // 2
            strips = {
                "game": game[top : top + canvas, canvas : canvas + columns],
                "served": scroll(prior, game, canvas, columns, salt=4 * i + turn, serial=False),
                "one_tile_at_a_time": scroll(prior, game, canvas, columns, salt=4 * i + turn, serial=True),
            }
            for name, strip in strips.items():
                figures[name].append(boundaries(strip, kinds))
                shares[name].append(np.bincount(kinds[strip].flatten(), minlength=4) / strip.size)
    mean = {k: np.mean(v, 0) for k, v in figures.items()}  # (along, across) per way of drawing
    results = {
        "model": args.model,
        "worlds": args.worlds,
        "columns": columns,
        "canvas": canvas,
        "kind_boundaries_along_new_lines": {k: round(float(v[0]), 4) for k, v in mean.items()},
        "kind_boundaries_across_new_lines": {k: round(float(v[1]), 4) for k, v in mean.items()},
        "kind_shares_grass_sand_water_wall": {k: np.mean(v, 0).round(4).tolist() for k, v in shares.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(results, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "terrain_fill.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Add a terrain prior (`models.tiny_world.terrain_prior`) to a tiny-world model directory.

    python -m models.tiny_world.terrain --model DIR [--out DIR2] [--seed S] [--steps N]

trains a prior on the training worlds' maps (`generate_world` for seeds 0 .. episodes - 1, as the
recipe's data) as the training run's `terrain` stage does (`train_terrain`, `TrainConfig`'s
terrain settings) and writes DIR (or a copy, DIR2) with DIR/terrain/ added: about a minute on 2
CPU cores. It reads only the maps and the autoencoder's codebook (`python -m
models.tiny_world.codebook` fits one; the prior's classes are its entries, in its order), so it
can be trained apart from every other stage. The examples and the training live in
`models.tiny_world.training.prior`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from models.game import GameConfig
from models.tiny_world.fast_decoder import FastAEConfig
from models.tiny_world.plugin import save_terrain
from models.tiny_world.training.config import TrainConfig
from models.tiny_world.training.prior import TerrainTrainConfig, class_maps, train_terrain


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a tiny-world model directory")
    parser.add_argument("--out", type=Path, default=None, help="write a copy here (default: DIR itself)")
    parser.add_argument("--seed", type=int, default=0, help="the training run's seed (default 0)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    recipe = TrainConfig()

    codebook = FastAEConfig.from_dict(json.loads((args.model / "vae" / "config.json").read_text())).codebook
    if not codebook:
        print(
            f"{args.model}: the autoencoder has no codebook; a terrain prior needs one "
            "(python -m models.tiny_world.codebook --model DIR)",
            file=sys.stderr,
        )
        return 2
    seeds = range(recipe.world_seed_base, recipe.world_seed_base + recipe.episodes)
    maps = class_maps(seeds, codebook, GameConfig())
    if args.out is not None and args.out.exists():
        print(f"{args.out} exists", file=sys.stderr)
        return 2
    steps = recipe.terrain_steps if args.steps is None else args.steps
    prior, figures = train_terrain(maps, codebook, TerrainTrainConfig(steps=steps), args.seed)
    out = args.model
    if args.out is not None:
        shutil.copytree(args.model, args.out)
        out = args.out
    save_terrain(prior, out)
    print(json.dumps(figures, indent=2))
    print(f"terrain prior written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

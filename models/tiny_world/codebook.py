"""Fit the codebook of a tiny-world model directory's autoencoder on training frames.

    python -m models.tiny_world.codebook --model DIR [--episodes 64] [--frames 64] [--k 8|auto] [--seed 0]

renders training episodes (`make_episodes` of seeds 0 .. episodes - 1, `frames` actions each: the
game is the training data), fits the codebook on the mean colours of their flat cells
(`models.tiny_world.training.codebook`: a seeded k-means, k entries, or with ``--k auto`` the
smallest k that covers the cells, `choose_k`) and writes it into DIR/vae/config.json as
"codebook" (an older directory's copied "palette" is dropped). A minute or so on 2 CPU cores.
The recipe's `ae` stage does the same after the autoencoder trains; this is for a directory
trained before it. The terrain prior names tiles by codebook entry, so retrain it after:
``python -m models.tiny_world.terrain --model DIR``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from models.tiny_world.data import make_episodes
from models.tiny_world.fast_decoder import FastAEConfig, FastAutoencoder
from models.tiny_world.training.codebook import choose_k, covered, fit_codebook, flat_colours

WEIGHTS = "diffusion_pytorch_model.safetensors"


def load_autoencoder(model: Path) -> tuple[FastAutoencoder, dict]:
    """The autoencoder of a model directory (CPU, eval) and its vae/config.json as read."""
    config = json.loads((model / "vae" / "config.json").read_text())
    ae = FastAutoencoder(FastAEConfig.from_dict(config))
    ae.load_state_dict(load_file(str(model / "vae" / WEIGHTS)))
    return ae.eval(), config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a tiny-world model directory")
    parser.add_argument("--episodes", type=int, default=64, help="training episodes (seeds 0 ..)")
    parser.add_argument("--frames", type=int, default=64, help="actions per episode")
    parser.add_argument("--k", default="8", help="codebook entries, or 'auto' (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="the k-means seed (default 0)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    ae, config = load_autoencoder(args.model)
    if not ae.cfg.frame_size:
        raise SystemExit(f"{args.model}: its autoencoder is not tile-aligned; it has no codebook")
    eps = make_episodes(range(args.episodes), args.frames, size=ae.cfg.frame_size)
    frames = eps.frames.reshape(-1, *eps.frames.shape[-3:])
    offsets = (np.rint(eps.cameras).astype(np.int64) % ae.cfg.spatial).reshape(-1, 2)
    colours = flat_colours(ae, frames, offsets)
    k = choose_k(colours, seed=args.seed) if args.k == "auto" else int(args.k)
    book = fit_codebook(colours, k, args.seed)
    config.pop("palette", None)
    config["codebook"] = book
    (args.model / "vae" / "config.json").write_text(json.dumps(config, indent=2))
    report = {"frames": len(frames), "flat_cells": len(colours), "k": k, "covered": covered(colours, book)}
    print(json.dumps({**report, "codebook": book}))
    print(f"codebook written to {args.model / 'vae' / 'config.json'}; retrain the terrain prior next")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Add a learned motion head (`models.tiny_world.motion_head`) to a tiny-world model directory.

    python -m models.tiny_world.motion --model DIR [--out DIR2] [--work SCRATCH] [--seed S] [--steps N]

trains a motion head for the model directory DIR on the training worlds' episodes (the recipe's
data, encoded with DIR's own autoencoder) as the training run's `motion` stage does
(`Trainer.train_motion`, `TrainConfig.motion_steps`) and writes DIR (or a copy, DIR2) with
DIR/motion/ added, replacing a key gate the directory may still hold: about 40 minutes on one
CPU core (encoding the episodes is about 8 of them; `--work` keeps them for another run). The labels
are what the episodes did: the camera's and the player's move in every frame and which held
keys moved nothing (`models.tiny_world.training.motion`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from models.tiny_world.plugin import save_motion
from models.tiny_world.training.config import TrainConfig
from models.tiny_world.training.trainer import Trainer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.tiny_world.motion", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", type=Path, required=True, help="tiny-world model directory")
    parser.add_argument(
        "--out", type=Path, default=None, help="write a copy with the head here (default: in place)"
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch directory (latents; default: beside the output, removed)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the training data and the head (default 0)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=TrainConfig.motion_steps,
        help=f"AdamW steps (default {TrainConfig.motion_steps})",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # before torch starts its workers: see models.tiny_world.train.main
    try:
        return add_motion(
            args.model, args.out, args.work, args.seed, args.steps, progress=not args.no_progress
        )
    finally:
        torch.set_flush_denormal(False)


def add_motion(
    model: Path, out: Path | None, work: Path | None, seed: int, steps: int, progress: bool
) -> int:
    """`main`: train a motion head for `model` and write it there or into a copy at `out`."""
    target = out or model
    if out is not None:
        if out.exists():
            raise SystemExit(f"{out} exists")
        shutil.copytree(model, out)
    scratch = work or target.parent / f".motion-{target.name}"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        trainer = Trainer(
            replace(TrainConfig(seed=seed), motion_steps=steps), scratch, None, progress=progress
        )
        trainer.init_from(model)
        trainer.train_motion()
        meta_path = target / "worldserve.json"
        meta = json.loads(meta_path.read_text())
        meta.get("plugin", {}).pop("gate", None)  # a key gate's hand-written plan is replaced
        meta_path.write_text(json.dumps(meta, indent=2))
        shutil.rmtree(target / "gate", ignore_errors=True)
        assert trainer.motion is not None
        save_motion(trainer.motion, target)
        record = json.loads(trainer.log_path.read_text().splitlines()[-1])
    finally:
        if work is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(record, indent=2))
    print(f"motion head written to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

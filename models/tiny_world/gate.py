"""Add a key gate (`models.tiny_world.key_gate`) to a tiny-world model directory.

    python -m models.tiny_world.gate --model DIR [--out DIR2] [--work SCRATCH] [--seed S]

trains a gate for the model directory DIR on the training worlds' episodes (the recipe's data,
encoded with DIR's own autoencoder) as the training run's `gate` stage does (`Trainer.train_gate`,
`TrainConfig`'s gate settings) and writes DIR (or a copy, DIR2) with DIR/gate/ added: about 15
minutes on 2 CPU cores. The labels are the game's rule on each world's map (`free_walk`): from
every recorded frame, how many of the next `horizon` frames holding each movement key still
moves the player, and how many of those the view still scrolls before the camera stops at the
world's edge (`camera_room`, for the gate's motion plan); the labels and the training live in
`models.tiny_world.training.gate`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from models.tiny_world.plugin import save_gate, served_plugin
from models.tiny_world.training.config import TrainConfig
from models.tiny_world.training.trainer import Trainer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.tiny_world.gate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", type=Path, required=True, help="tiny-world model directory")
    parser.add_argument(
        "--out", type=Path, default=None, help="write a copy with the gate here (default: in place)"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="scratch directory (latents; default: beside the output)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the training data and the gate (default 0)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # before torch starts its workers: see models.tiny_world.train.main
    try:
        return add_gate(args.model, args.out, args.work, args.seed, progress=not args.no_progress)
    finally:
        torch.set_flush_denormal(False)


def add_gate(model: Path, out: Path | None, work: Path | None, seed: int, progress: bool) -> int:
    """`main`: train a gate for `model` and write it there or into a copy at `out`. The episodes'
    latents live in `work` (kept, for another run to reuse) or in a scratch directory beside the
    output (removed)."""
    target = out or model
    if out is not None:
        if out.exists():
            raise SystemExit(f"{out} exists")
        shutil.copytree(model, out)
    scratch = work or target.parent / f".gate-{target.name}"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        trainer = Trainer(TrainConfig(seed=seed), scratch, None, progress=progress)
        trainer.init_from(model)
        trainer.train_gate()
        save_gate(trainer.gate, target)
        meta = json.loads((target / "worldserve.json").read_text())
        served = served_plugin(gate=trainer.gate)  # as the recipe exports it
        settings = served.settings.to_dict()
        meta["plugin"]["atlas_tiles"] = settings["atlas_tiles"]
        (target / "worldserve.json").write_text(json.dumps(meta, indent=2))
        record = json.loads(trainer.log_path.read_text().splitlines()[-1])
    finally:
        if work is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(record, indent=2))
    print(f"key gate written to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

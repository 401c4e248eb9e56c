"""The command line shared by the scripts that add a learned head to a tiny-world model directory
(models/tiny_world/motion.py, models/tiny_world/creatures.py): the same flags, the same copy and
scratch handling, a `Trainer` started from the directory (`Trainer.init_from`) whose stage
trains the head."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from models.tiny_world.training.config import TrainConfig
from models.tiny_world.training.trainer import Trainer


@dataclass(frozen=True)
class HeadScript:
    """One head's script."""

    module: str  # e.g. "models.tiny_world.motion" (its docstring's first line describes it)
    doc: str
    head: str  # what it adds, in messages: "motion head"
    steps_field: str  # the `TrainConfig` field of its stage's steps
    # Trains the trainer's head (its stage's method) and writes it into the target directory.
    add: Callable[[Trainer, Path], None]
    # Raises SystemExit when the model directory cannot take the head (None: any can).
    check: Callable[[Path], None] | None = None


def main(script: HeadScript, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and add the head (`run`)."""
    default = getattr(TrainConfig, script.steps_field)
    parser = argparse.ArgumentParser(prog=f"python -m {script.module}", description=script.doc.split("\n")[0])
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
    parser.add_argument("--steps", type=int, default=default, help=f"AdamW steps (default {default})")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # before torch starts its workers: see models.tiny_world.train.main
    try:
        return run(script, args.model, args.out, args.work, args.seed, args.steps, not args.no_progress)
    finally:
        torch.set_flush_denormal(False)


def run(
    script: HeadScript,
    model: Path,
    out: Path | None,
    work: Path | None,
    seed: int,
    steps: int,
    progress: bool,
) -> int:
    """Train the head for `model` and write it there or into a copy at `out`; prints its record."""
    if script.check is not None:
        script.check(model)
    target = out or model
    if out is not None:
        if out.exists():
            raise SystemExit(f"{out} exists")
        shutil.copytree(model, out)
    scratch = work or target.parent / f".{script.head.replace(' ', '-')}-{target.name}"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        cfg = replace(TrainConfig(seed=seed), **{script.steps_field: steps})
        trainer = Trainer(cfg, scratch, None, progress=progress)
        trainer.init_from(model)
        script.add(trainer, target)
        record = json.loads(trainer.log_path.read_text().splitlines()[-1])
    finally:
        if work is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(record, indent=2))
    print(f"{script.head} written to {target}")
    return 0

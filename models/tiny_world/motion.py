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

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from models.tiny_world.add_head import HeadScript
from models.tiny_world.add_head import main as add_head
from models.tiny_world.plugin import save_motion
from models.tiny_world.training.trainer import Trainer


def add_motion(trainer: Trainer, target: Path) -> None:
    """Train `trainer`'s motion head and write it into `target`, replacing a key gate there."""
    trainer.train_motion()
    meta_path = target / "worldserve.json"
    meta = json.loads(meta_path.read_text())
    meta.get("plugin", {}).pop("gate", None)  # a key gate's hand-written plan is replaced
    meta_path.write_text(json.dumps(meta, indent=2))
    shutil.rmtree(target / "gate", ignore_errors=True)
    assert trainer.motion is not None
    save_motion(trainer.motion, target)


SCRIPT = HeadScript("models.tiny_world.motion", __doc__, "motion head", "motion_steps", add_motion)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    return add_head(SCRIPT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
